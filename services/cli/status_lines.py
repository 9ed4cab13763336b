"""`deepinfer status`'s lines: a pool's size against its target (in instances when each engine is
an instance of several ranks), and below a worker's row where its prompts' KV came from (prefix
cache, then each KV store tier), its local prefills, and how the router scores prefill engines."""

from __future__ import annotations

from deepinfer_proto import common_pb2

PREFILL_SCORE = (
    "  prefill choice: the lowest score = queued prompt tokens + this prompt's tokens the engine does not "
    "hold (its remembered prefix chunks of 16 tokens); engines holding a prefix compete outside their length bucket"
)


def pool_size(pool: common_pb2.PoolStatus) -> str:
    """Engines against the target. A pool of expert-parallel instances counts instances (its target
    does: instances scale whole), each with the ranks it has in the router; an instance missing a
    rank is named (it is failing, or still starting)."""
    if pool.ranks_per_instance <= 1:
        return f"{len(pool.workers)} worker(s), target {pool.target}"
    ranks: dict[str, int] = {}
    for w in pool.workers:
        instance = w.info.worker_id.rsplit(".", 1)[0]  # rank workers are "<instance>.<rank>"
        ranks[instance] = ranks.get(instance, 0) + 1
    size = pool.ranks_per_instance
    line = f"{len(ranks)} instance(s) of {size} ranks ({len(pool.workers)} rank workers), target {pool.target}"
    partial = [f"{i} has {n} of {size} ranks" for i, n in sorted(ranks.items()) if n != size]
    return line + (f"; {', '.join(partial)}" if partial else "")


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cache_line(w: common_pb2.WorkerStatus) -> str:
    """Prompt tokens by tier: L1 the engine's prefix cache, L2 its host pool, L3 the store's files."""
    x = w.load
    parts = [f"prefix cache {_pct(x.prefix_hits, x.prefix_queries)} of {x.prefix_queries} tokens"]
    looked = x.kv_store_hit_tokens_l2 + x.kv_store_hit_tokens_l3 + x.kv_store_miss_tokens
    if looked or x.kv_store_l2_capacity_bytes:
        parts.append(
            f"store hits l2 {_pct(x.kv_store_hit_tokens_l2, looked)} l3 {_pct(x.kv_store_hit_tokens_l3, looked)} "
            f"of {looked} tokens looked up"
        )
        parts.append(
            f"l2 {_size(x.kv_store_l2_bytes)}/{_size(x.kv_store_l2_capacity_bytes)}, "
            f"l3 {_size(x.kv_store_l3_bytes)}/{_size(x.kv_store_l3_capacity_bytes)}"
        )
        if x.kv_store_corrupt_entries or x.kv_store_load_failures:
            parts.append(f"{x.kv_store_corrupt_entries} corrupt, {x.kv_store_load_failures} failed loads")
    if x.local_prefills:
        parts.append(f"{x.local_prefills} local prefills")
    if x.spec_draft_tokens:
        parts.append(spec_part(x))
    if w.prefix_chunks:
        parts.append(f"router remembers {w.prefix_chunks} prefix chunks")
    return "      " + "; ".join(parts)


def spec_part(x: common_pb2.WorkerLoad) -> str:
    """MTP acceptance: overall, then per draft position (1st, 2nd, ... token drafted)."""
    per = " ".join(
        f"{j + 1}:{_pct(a, p)}"
        for j, (p, a) in enumerate(zip(x.spec_proposed_per_position, x.spec_accepted_per_position))
    )
    return f"mtp acceptance {_pct(x.spec_accepted_tokens, x.spec_draft_tokens)} of {x.spec_draft_tokens} drafts ({per})"
