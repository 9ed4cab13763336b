"""MTP speculative decoding: output tokens/s and acceptance rate with nextn = 0, 1, 2 (not a test).

Two models:
- `tiny` (default): the embedded tiny model on CPU, its MTP layer as built in (the target's last
  layer re-applied to the target's hidden state: a weak draft, so acceptance is low);
- `dsv3`: a DeepSeek-V3-shaped model (V3's widths, 128 heads, 256 routed experts, top-8; fewer
  layers so that one GPU holds it) with random weights made on the device (`load_format="dummy"`),
  whose MTP layer is made from the target's last layer (`init_from_target_last_layer`).
  Random weights make the draft's acceptance low; it is reported as measured.

`--draft fitted` replaces either MTP layer by one distilled from the target (`fit_draft`).

    python benchmarks/spec_decode.py                                   # tiny, CPU
    python benchmarks/spec_decode.py --model dsv3 --device cuda --batch 32 --max-tokens 128 --profile
    python benchmarks/spec_decode.py --model dsv3 --device cuda --dtype float32 --experts 32  # equality

Each nextn runs the same greedy requests on a fresh engine after a short warm-up run; outputs are
checked equal to nextn = 0's (greedy verification is exact up to rounding: a different batch shape
may flip a near-tie). Where they differ, the first differing position is reported with the
nextn = 0 run's logit margin there (top-1 minus top-2 log-probability, from a second pass of the
same requests with logprobs). `--profile` times the phases of the drafting steps (device-synced).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: imports resolve from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer_core.builtin import TINY_MODEL_DIR  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.engine_args import EngineArgs  # noqa: E402
from deepinfer_core.sampling_params import SamplingParams  # noqa: E402
from deepinfer_core.spec_decode.slots import SpecStats  # noqa: E402

DSV3_SHAPED = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4, first_k_dense_replace=3,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    n_group=8, topk_group=4, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=2.5, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, num_nextn_predict_layers=1,
    torch_dtype="bfloat16", initializer_range=0.02,
)  # fmt: skip


def engine_args(args, nextn: int, path: str | None) -> EngineArgs:
    common = dict(device=args.device, num_speculative_tokens=nextn, max_num_seqs=max(args.batch, 8), seed=0)
    if args.model == "tiny":
        return EngineArgs(max_model_len=1024, num_gpu_blocks=1024, **common)
    return EngineArgs(model=path, tokenizer=TINY_MODEL_DIR, load_format="dummy", dtype=args.dtype,
                      max_model_len=2048, gpu_memory_utilization=0.85, **common)  # fmt: skip


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    """(seconds, output token ids per prompt, logprobs per prompt or None)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    for j, p in enumerate(prompts):
        engine.add_request(f"b{j}-{time.monotonic_ns()}", params=params, prompt_token_ids=p)
    start, done = time.perf_counter(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    order = sorted(done, key=lambda r: int(r[1 : r.index("-")]))
    return time.perf_counter() - start, [done[k].token_ids for k in order], [done[k].logprobs for k in order]


class PhaseTimer:
    """Device-synced wall time of the methods a step is made of, summed per phase."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.worst: dict[str, float] = {}
        self._wrapped: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        for obj, name, inner in reversed(self._wrapped):
            setattr(obj, name, inner)

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        self._wrapped.append((obj, name, inner))

        def timed(*a, **kw):
            self.sync()
            t = time.perf_counter()
            result = inner(*a, **kw)
            self.sync()
            dt = time.perf_counter() - t
            self.seconds[phase] = self.seconds.get(phase, 0.0) + dt
            self.calls[phase] = self.calls.get(phase, 0) + 1
            self.worst[phase] = max(self.worst.get(phase, 0.0), dt)
            return result

        setattr(obj, name, timed)

    def table(self) -> str:
        return "\n".join(
            f"    {p:<34} {self.calls[p]:5d} calls  {1e3 * s / self.calls[p]:8.2f} ms/call  "
            f"max {1e3 * self.worst[p]:8.2f} ms  total {s:6.2f} s"
            for p, s in self.seconds.items()
        )


def profile(engine: LLMEngine, args, prompts: list[list[int]]) -> str:
    """Phase times of one more run of the requests (after the measured one: kernels compiled)."""
    timer = PhaseTimer(args.device)
    timer.wrap(engine, "step", "engine.step")
    timer.wrap(engine.worker.runner, "_forward", "target forward")
    if engine.spec is not None:
        timer.wrap(engine.spec, "launch", "spec.launch (verify)")
        timer.wrap(engine.spec, "propose", "spec.propose (draft)")
        timer.wrap(engine.spec, "_run", "draft layer forward")
        timer.wrap(engine.worker.draft, "compute_logits", "draft logits")
    # eager calls only (graph replays run no Python): which attention / MoE path the steps take
    from deepinfer_core.models.layers import mla, moe

    for module, name in ((mla, "mla_attention_naive"), (mla, "mla_attention_absorbed"), (mla.ops, "mla_decode_attention"),
                         (moe.ops, "fused_experts")):  # fmt: skip
        timer.wrap(module, name, f"  eager {name}")
    try:
        run(engine, prompts, args.max_tokens)
    finally:
        timer.restore()  # a later engine captures graphs: no syncs may be left inside them
    return timer.table()


@torch.inference_mode()
def fit_draft(engine: LLMEngine, seq_len: int = 2048, chunk: int = 8) -> None:
    """Distil the MTP layer from the target as a per-token table: every vocabulary token is fed once
    (a random permutation of the vocabulary cut into `seq_len`-token sequences, seed 1) and the
    target's final hidden state there (before its norm's weight) becomes that token's row of the
    draft's own embedding; `eh_proj` passes that row, and the decoder block's output projections
    (attention o_proj, the experts' and shared experts' down) are zeroed. The draft then proposes,
    for token t, what the target predicted after t in a random context: the target's next token to
    the extent that it depends on the last token only. The layer's attention and MoE still run, so
    a drafting step costs what it would with trained weights. The draft graphs are captured again
    (its embedding is a new tensor)."""
    from torch import nn

    from deepinfer_core.sequence import Sequence
    from deepinfer_core.worker.cache_engine import CacheEngine
    from deepinfer_core.worker.cuda_graph import DraftGraphs
    from deepinfer_core.worker.input_batch import build_model_input

    worker = engine.worker
    model, mtp, runner = worker.model, worker.draft, worker.runner
    lm = getattr(model, "language_model", model)
    h, bs, dev = mtp.args.hidden_size, runner.block_size, runner.device
    embed = lm.model.embed_tokens.weight
    vocab = embed.shape[0]
    seq_len = min(seq_len, runner.config.scheduler.max_model_len)
    w_norm = lm.model.norm.weight.float()
    w_norm = torch.where(w_norm.abs() > 1e-6, w_norm, torch.ones_like(w_norm))
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(vocab, generator=gen)
    fill = (-vocab) % seq_len  # the last sequence topped up with random tokens
    order = torch.cat([order, torch.randint(0, vocab, (fill,), generator=gen)]).view(-1, seq_len)
    table = torch.empty_like(embed)
    nb = (seq_len + bs - 1) // bs
    scratch = CacheEngine(model.num_kv_cache_layers, model.kv_cache_block_shape(bs), chunk * nb, embed.dtype, dev)
    for c in range(0, order.shape[0], chunk):
        rows = order[c : c + chunk]
        seqs = []
        for i, row in enumerate(rows.tolist()):
            seq = Sequence(i, f"fit-{c + i}", row, SamplingParams(max_tokens=1))
            seq.block_table = list(range(i * nb, (i + 1) * nb))
            seqs.append(seq)
        inp = build_model_input(seqs, [seq_len] * len(seqs), bs, dev)
        hidden = model(inp.input_ids, inp.positions, scratch.kv_caches, inp.attn_meta)  # [n * L, H]
        table[inp.input_ids] = (hidden.float() / w_norm).to(table.dtype)
    del scratch
    mtp.embed_tokens.weight = nn.Parameter(table, requires_grad=False)
    mtp.eh_proj.weight.zero_()
    mtp.eh_proj.weight[:, :h].copy_(torch.eye(h, dtype=mtp.eh_proj.weight.dtype))
    mtp.enorm.weight.fill_(1.0)
    mtp.block.self_attn.o_proj.weight.zero_()
    for name, param in mtp.block.mlp.named_parameters():
        if name in ("down_proj.weight", "experts.w2_weight", "shared_experts.down_proj.weight"):
            param.zero_()
    if runner.draft_graphs is not None:
        runner.draft_graphs = None
        runner.draft_graphs = DraftGraphs.capture(runner, mtp)


def measure(args, nextn: int, path: str | None, prompts: list[list[int]]) -> dict:
    engine = LLMEngine.from_engine_args(engine_args(args, nextn, path))
    if engine.spec is not None and args.draft == "fitted":
        t = time.perf_counter()
        fit_draft(engine)
        print(f"  draft fitted in {time.perf_counter() - t:.1f} s", flush=True)
    run(engine, prompts, 8)  # warm-up at the measured batch: kernels compile here, not in the measurement
    if engine.spec is not None:  # count the measured requests only
        engine.spec.slots.stats = SpecStats(proposed_at=[0] * nextn, accepted_at=[0] * nextn)
    seconds, outputs, _ = run(engine, prompts, args.max_tokens)
    stats = engine.spec.slots.stats if engine.spec is not None else None
    row = dict(nextn=nextn, tokens_per_s=sum(map(len, outputs)) / seconds, seconds=seconds, outputs=outputs)
    if stats is not None:
        row["acceptance"] = stats.accepted_tokens / max(stats.draft_tokens, 1)
        row["per_position"] = [a / max(p, 1) for p, a in zip(stats.proposed_at, stats.accepted_at)]
        row["tokens_per_step"] = 1 + stats.accepted_tokens / max(sum(stats.proposed_at[:1]), 1)
    if nextn == 0 and args.margins:  # the same requests again, with the top-2 log-probabilities
        _, again, row["logprobs"] = run(engine, prompts, args.max_tokens, logprobs=2)
        row["logprob_pass_same"] = again == outputs
    if args.profile:
        row["profile"] = profile(engine, args, prompts)
    del engine  # its weights and KV cache go before the next configuration's engine is built
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def first_difference(base: dict, row: dict) -> str:
    """Where row's outputs first leave nextn 0's, with nextn 0's logit margin there."""
    diffs = []
    for r, (a, b) in enumerate(zip(base["outputs"], row["outputs"])):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            diffs.append((j, r))
    if not diffs:
        return ""
    j, r = min(diffs)
    text = f"  {len(diffs)}/{len(base['outputs'])} requests differ; first at request {r} token {j}"
    lps = base.get("logprobs")
    if lps and lps[r] and lps[r][j]:
        top = sorted(lps[r][j].items(), key=lambda kv: -kv[1])
        mine = row["outputs"][r][j]
        text += (
            f": nextn 0 chose {base['outputs'][r][j]}, this run {mine}; nextn 0's margin top1-top2 "
            f"{top[0][1] - top[1][1]:.4f} (top2 = {top[1][0]}{', the token this run chose' if top[1][0] == mine else ''})"
        )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "dsv3"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="dsv3 only")
    ap.add_argument("--experts", type=int, default=None, help="dsv3: routed experts (default V3's 256)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--nextn", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--draft", choices=("last-layer", "fitted"), default="last-layer",
                    help="the MTP layer: as loaded (the target's last layer re-applied) or distilled (`fit_draft`)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="phase times of one more run per nextn")
    ap.add_argument("--no-margins", dest="margins", action="store_false", help="skip the logprob pass of nextn 0")
    ap.add_argument("--json", default=None, help="write the rows (outputs included) here")
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = 1000 if args.model == "tiny" else DSV3_SHAPED["vocab_size"] - 1
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if args.model == "dsv3":
            config = dict(DSV3_SHAPED, torch_dtype=args.dtype)
            if args.experts:
                config["n_routed_experts"] = args.experts
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            path = tmp
        rows = []
        for n in args.nextn:
            rows.append(measure(args, n, path, prompts))
            report(rows[-1], rows[0] if rows[0]["nextn"] == 0 else None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


def report(r: dict, base: dict | None) -> None:
    same = ""
    if base is not None and r is not base:
        same = f"  outputs {'==' if r['outputs'] == base['outputs'] else '!='} nextn 0" + first_difference(base, r)
    acc = ""
    if "acceptance" in r:
        acc = f"  acceptance {r['acceptance']:.1%} per position " + " ".join(f"{p:.1%}" for p in r["per_position"])
    steps = f"  {r['tokens_per_step']:.2f} tokens/step" if "tokens_per_step" in r else ""
    print(f"nextn {r['nextn']}: {r['tokens_per_s']:8.1f} tokens/s ({r['seconds']:.2f} s){steps}{acc}{same}", flush=True)
    if "profile" in r:
        print(r["profile"], flush=True)


if __name__ == "__main__":
    main()
