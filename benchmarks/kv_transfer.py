"""KV hand-off through the transfer plane: bandwidth per hand-off against a local copy of the
same bytes, and the hand-off's share of time-to-first-token — measured side by side in one run.

The PE runs in this process, the CE in another (as deployed: transfers always cross processes).
"plane": one WRITE made, posted and waited back to back, "ratio" = copy time / plane time;
"posted" = the same ratio from posting on (a PE makes its hand-offs' requests while the forward
runs, so posting to DONE is what follows the forward). "hand-off": first post to DONE inside a
real prefill step (with layer groups, the first group goes out while later layers compute, and
sampling and output processing run in between, so it includes their time).

    python benchmarks/kv_transfer.py                          # CPU: DRAM -> DRAM over UCX loopback
    python benchmarks/kv_transfer.py --pe-device cuda:0 --ce-device cuda:1   # two GPUs, VRAM -> VRAM
    python benchmarks/kv_transfer.py ... --chunk 4096   # chunked prefill: streamed vs whole hand-off
    python benchmarks/kv_transfer.py ... --posting      # a raw write's request, post and wait

With `--chunk N` the PE (and the NORMAL reference) prefill in chunks of N tokens, and each prompt
is handed off twice side by side: with each chunk's full blocks written while the next chunk
computes (DEEPINFER_PD_STREAM_CHUNKS, the default) and with everything written after the last
chunk. With `--layer-groups G` (no chunking) each prompt goes once as one write after the
forward and once in G layer groups, each posted as soon as the forward has written its layers.
"exposed" = from the end of the last forward to DONE, the part of TTFT the hand-off adds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

if __package__ in (None, ""):  # run as a script: its sibling modules import as `benchmarks.X` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pd_harness import EngineProcess  # noqa: E402
from deepinfer_core import envs  # noqa: E402
from deepinfer_core.builtin import TINY_MODEL_DIR  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.engine_args import EngineArgs  # noqa: E402
from deepinfer_core.pd.prompt_engine import PromptEngine  # noqa: E402
from deepinfer_core.roles import EngineType  # noqa: E402
from deepinfer_core.sampling_params import SamplingParams  # noqa: E402
from deepinfer_core.transfer.messages import HandoffNotice, KVTarget  # noqa: E402

# Many KV bytes per token, little compute: 16 layers x 8 KV heads x 128 dims.
MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=1024,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def build_checkpoint(path: str) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", f"{path}/{name}")


def copy_reference(num_bytes: int, src_device: str, dst_device: str, reps: int = 5) -> float:
    """Seconds for a plain copy of the same bytes (memcpy on CPU, peer-to-peer on GPUs)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=dst_device)
    times = []
    for _ in range(reps + 1):
        _sync(src_device, dst_device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(src_device, dst_device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def handoff(pe: PromptEngine, ce: EngineProcess, rid: str, prompt: list[int]) -> tuple[float, object]:
    """One request through reserve -> prefill -> KV write -> notice; returns (seconds, HandoffResult)."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    t = time.perf_counter()
    target = KVTarget.from_bytes(ce.call("reserve", rid, params, prompt, 600.0))
    pe.add_prefill(rid, target, params, prompt)
    results = []
    while not results:
        pe.step()
        results = pe.pop_handoff_results()
    elapsed = time.perf_counter() - t
    assert results[0].ok, results[0].error
    # let the CE finish the request before the next one: its decode step would otherwise delay
    # the next reservation, and whichever variant runs second would pay for it
    deadline = time.monotonic() + 60
    while not any(o.request_id == rid and o.finished for o in ce.call("collect")[0]):
        assert time.monotonic() < deadline, f"the CE did not finish {rid}"
        pe.poll_handoffs()  # as an engine loop does between steps
    return elapsed, results[0]


def raw_write(pe: PromptEngine, ce: EngineProcess, rid: str, num_tokens: int) -> tuple[float, float, int, float]:
    """The plane alone: one WRITE of num_tokens' blocks into a CE reservation, made, posted and
    waited back to back (no forward, no sampling in between). Returns (seconds from making the
    request, seconds from posting it, bytes, seconds the post call took): a PE makes its
    hand-offs' requests while the forward runs, so the second is what a hand-off's posting adds
    after the forward."""
    params = SamplingParams(temperature=0, max_tokens=1)
    target = KVTarget.from_bytes(ce.call("reserve", rid, params, [1] * num_tokens, 600.0))
    nblocks = pe.scheduler.block_manager.blocks_needed(num_tokens)
    local = list(range(nblocks))  # any PE blocks: only the bytes moved matter here
    t = time.perf_counter()
    write = pe.agent.prepare_write(
        target.engine_id,
        local,
        target.base_addr,
        target.num_blocks_total,
        target.block_ids,
        target.device_id,
        target.mem_type,
    )
    posted = time.perf_counter()
    transfer = pe.agent.post(write)
    post_call = time.perf_counter() - posted
    pe.agent.wait(transfer, 60.0)
    end = time.perf_counter()
    # end the reservation the way a failed hand-off does: the CE frees its blocks at once
    pe.agent.send_notif(target.engine_id, HandoffNotice(request_id=rid, ok=False, error="benchmark").to_bytes())
    return end - t, end - posted, transfer.num_bytes, post_call


def engines(args, path: str, dtype: str, max_len: int, block_size: int, chunk: int = 0):
    """(CE process, PE here, NORMAL engine here), connected and warmed up; `chunk`: chunked prefill."""
    common = dict(model=path, dtype=dtype, max_model_len=max_len, block_size=block_size,
                  max_num_batched_tokens=chunk or max_len, chunked_prefill=bool(chunk), enable_prefix_caching=False)  # fmt: skip
    blocks = 2 * (max_len // block_size + 2)
    ce = EngineProcess(
        EngineType.COMPLETION,
        {**common, "device": args.ce_device, "num_gpu_blocks": blocks, "stop_preempted_request": True},
    )
    pe = PromptEngine.from_engine_args(
        EngineArgs(engine_type=EngineType.PROMPT, device=args.pe_device, num_gpu_blocks=blocks, **common)
    )
    normal = LLMEngine.from_engine_args(EngineArgs(device=args.pe_device, num_gpu_blocks=blocks, **common))
    pe.connect_peer(ce.info["agent_name"], ce.info["agent_metadata"], ce.info["kv_region"])
    handoff(pe, ce, "warmup", list(range(1, 64)))
    normal_ttft(normal, "warmup", list(range(1, 64)))
    return ce, pe, normal


def normal_ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    t = time.perf_counter()
    engine.add_request(rid, params=params, prompt_token_ids=prompt)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    elapsed = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pe-device", default="cpu")
    ap.add_argument("--ce-device", default="cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=0, help="chunked prefill of this many tokens (0: one pass)")
    ap.add_argument("--layer-groups", type=int, default=0, help="compare one write with this many layer groups")
    ap.add_argument("--posting", action="store_true", help="where a raw write's time goes: request, post, wait")
    args = ap.parse_args()
    dtype = "bfloat16" if args.pe_device.startswith("cuda") else "float32"
    max_len = max(args.lengths) + 16
    path = tempfile.mkdtemp()
    build_checkpoint(path)
    print(f"PE {args.pe_device} -> CE {args.ce_device}, {dtype}, model layers=16 kv_heads=8 head_dim=128")
    if args.chunk or args.layer_groups:
        return side_by_side(args, dtype, max_len, path)
    if args.posting:
        return posting(args, dtype, max_len, path)
    print(
        f"{'block':>5} {'tokens':>6} {'MiB':>7} {'plane GB/s':>10} {'copy GB/s':>9} {'ratio':>6} {'posted':>6} "
        f"{'hand-off ms':>11} {'exposed ms':>10} {'TTFT NORMAL ms':>14} {'TTFT P/D ms':>11} {'exposed %':>9}"
    )
    for block_size in args.block_sizes:
        ce, pe, normal = engines(args, path, dtype, max_len, block_size)
        for n in args.lengths:
            prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            pd_t, xfer_t, exposed_t, nbytes, normal_t = [], [], [], 0, []
            for r in range(args.reps):
                seconds, result = handoff(pe, ce, f"b{block_size}-{n}-{r}", prompt)
                pd_t.append(seconds)
                xfer_t.append(result.seconds)
                exposed_t.append(result.exposed_seconds)
                nbytes = result.num_bytes
                normal_t.append(normal_ttft(normal, f"n{block_size}-{n}-{r}", prompt))
            raw = [raw_write(pe, ce, f"raw{block_size}-{n}-{r}", n) for r in range(args.reps)]
            plane, posted = statistics.median(w[0] for w in raw), statistics.median(w[1] for w in raw)
            copy = copy_reference(nbytes, args.pe_device, args.ce_device)
            xfer, exposed = statistics.median(xfer_t), statistics.median(exposed_t)
            pd, nt = statistics.median(pd_t), statistics.median(normal_t)
            print(
                f"{block_size:>5} {n:>6} {nbytes / 2**20:>7.1f} {nbytes / plane / 1e9:>10.2f} "
                f"{nbytes / copy / 1e9:>9.2f} {copy / plane:>6.2f} {copy / posted:>6.2f} {xfer * 1e3:>11.2f} "
                f"{exposed * 1e3:>10.2f} {nt * 1e3:>14.1f} {pd * 1e3:>11.1f} {100 * exposed / pd:>8.1f}%"
            )
        ce.close()
        del pe, normal
    shutil.rmtree(path, ignore_errors=True)


def posting(args, dtype: str, max_len: int, path: str) -> None:
    """Raw writes only, split into making the request (`prepare_write`), the post call and the wait
    for DONE, against a plain copy of the same bytes. Medians of `--reps` after one warm-up write."""
    print(
        f"{'block':>5} {'tokens':>6} {'MiB':>7} {'request us':>10} {'post us':>8} {'wait us':>8} {'copy us':>8} "
        f"{'posted':>6} {'with request':>12}"
    )
    for block_size in args.block_sizes:
        ce, pe, normal = engines(args, path, dtype, max_len, block_size)
        for n in args.lengths:
            raw = [raw_write(pe, ce, f"post{block_size}-{n}-{r}", n) for r in range(args.reps + 1)][1:]
            whole, posted = statistics.median(w[0] for w in raw), statistics.median(w[1] for w in raw)
            post_call, nbytes = statistics.median(w[3] for w in raw), raw[0][2]
            request = statistics.median(w[0] - w[1] for w in raw)
            copy = copy_reference(nbytes, args.pe_device, args.ce_device)
            print(
                f"{block_size:>5} {n:>6} {nbytes / 2**20:>7.1f} {request * 1e6:>10.0f} {post_call * 1e6:>8.0f} "
                f"{(posted - post_call) * 1e6:>8.0f} {copy * 1e6:>8.0f} {copy / posted:>6.2f} {copy / whole:>12.2f}"
            )
        ce.close()
        del pe, normal


def side_by_side(args, dtype: str, max_len: int, path: str) -> None:
    """TTFT and exposed hand-off of PE variants, each prompt through every variant in turn:
    --chunk: streamed chunk writes vs one write at the end; --layer-groups: layer groups vs one write."""
    if args.chunk:
        variants = {"whole": lambda pe: setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", False),
                    "streamed": lambda pe: setattr(envs, "DEEPINFER_PD_STREAM_CHUNKS", True)}  # fmt: skip
        print(f"chunk {args.chunk} tokens; layer groups {args.layer_groups or 'default'}")
    else:
        variants = {"1 group": lambda pe: pe.set_layer_groups(1),
                    f"{args.layer_groups} groups": lambda pe: pe.set_layer_groups(args.layer_groups)}  # fmt: skip
    names = list(variants)
    print(
        f"{'block':>5} {'tokens':>6} {'MiB':>7} {'TTFT NORMAL ms':>14} "
        + " ".join(f"{'TTFT P/D ' + n:>18}" for n in names) + " "
        + " ".join(f"{'exposed ' + n + ' ms':>20}" for n in names) + " "
        + " ".join(f"{'share ' + n:>15}" for n in names)
    )  # fmt: skip
    for block_size in args.block_sizes:
        ce, pe, normal = engines(args, path, dtype, max_len, block_size, chunk=args.chunk)
        if args.chunk and args.layer_groups:
            pe.set_layer_groups(args.layer_groups)
        for n in args.lengths:
            prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            ttft, exposed = {v: [] for v in names}, {v: [] for v in names}
            normal_t, nbytes = [], 0
            for r in range(args.reps):
                for v in names:
                    variants[v](pe)
                    seconds, result = handoff(pe, ce, f"{v}-{block_size}-{n}-{r}", prompt)
                    ttft[v].append(seconds)
                    exposed[v].append(result.exposed_seconds)
                    nbytes = result.num_bytes
                normal_t.append(normal_ttft(normal, f"n{block_size}-{n}-{r}", prompt))
            med = statistics.median
            t = {v: med(ttft[v]) for v in names}
            e = {v: med(exposed[v]) for v in names}
            print(
                f"{block_size:>5} {n:>6} {nbytes / 2**20:>7.1f} {med(normal_t) * 1e3:>14.1f} "
                + " ".join(f"{t[v] * 1e3:>18.1f}" for v in names) + " "
                + " ".join(f"{e[v] * 1e3:>20.2f}" for v in names) + " "
                + " ".join(f"{100 * e[v] / t[v]:>14.1f}%" for v in names)
            )  # fmt: skip
        envs.DEEPINFER_PD_STREAM_CHUNKS = True
        ce.close()
        del pe, normal
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
