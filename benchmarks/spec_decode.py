"""MTP speculative decoding: output tokens/s and acceptance rate with nextn = 0, 1, 2 (not a test).

Two models:
- `tiny` (default): the embedded tiny model on CPU, its MTP layer as built in (the target's last
  layer re-applied to the target's hidden state: a weak draft, so acceptance is low);
- `dsv3`: a DeepSeek-V3-shaped model (V3's widths, 128 heads, 256 routed experts, top-8; fewer
  layers so that one GPU holds it) with random weights made on the device (`load_format="dummy"`),
  the MTP layer initialised from the target's last layer (`init_from_target_last_layer`).
  Random weights make the draft's acceptance low; it is reported as measured.

    python benchmarks/spec_decode.py                                   # tiny, CPU
    python benchmarks/spec_decode.py --model dsv3 --device cuda --batch 32 --max-tokens 128

Each nextn runs the same greedy requests on a fresh engine after one warm-up request; outputs are
checked equal to nextn = 0's (greedy verification is exact).
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
from deepinfer_core.spec_decode.draft_model import init_from_target_last_layer  # noqa: E402
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


def engine_args(model: str, device: str, nextn: int, path: str | None, batch: int) -> EngineArgs:
    common = dict(device=device, num_speculative_tokens=nextn, max_num_seqs=max(batch, 8), seed=0)
    if model == "tiny":
        return EngineArgs(max_model_len=1024, num_gpu_blocks=1024, **common)
    return EngineArgs(model=path, tokenizer=TINY_MODEL_DIR, load_format="dummy", dtype="bfloat16",
                      max_model_len=2048, gpu_memory_utilization=0.85, **common)  # fmt: skip


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for j, p in enumerate(prompts):
        engine.add_request(f"b{j}-{time.monotonic_ns()}", params=params, prompt_token_ids=p)
    start, done = time.perf_counter(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [done[k] for k in sorted(done, key=lambda r: int(r[1 : r.index("-")]))]


def measure(args, nextn: int, path: str | None, prompts: list[list[int]]) -> dict:
    engine = LLMEngine.from_engine_args(engine_args(args.model, args.device, nextn, path, args.batch))
    if engine.spec is not None and args.model != "tiny":
        init_from_target_last_layer(engine.worker.draft, engine.worker.model)
    run(engine, prompts[:1], 8)  # warm-up
    if engine.spec is not None:  # count the measured requests only
        engine.spec.slots.stats = SpecStats(proposed_at=[0] * nextn, accepted_at=[0] * nextn)
    seconds, outputs = run(engine, prompts, args.max_tokens)
    stats = engine.spec.slots.stats if engine.spec is not None else None
    row = dict(nextn=nextn, tokens_per_s=sum(map(len, outputs)) / seconds, seconds=seconds, outputs=outputs)
    if stats is not None:
        row["acceptance"] = stats.accepted_tokens / max(stats.draft_tokens, 1)
        row["per_position"] = [a / max(p, 1) for p, a in zip(stats.proposed_at, stats.accepted_at)]
    del engine  # its weights and KV cache go before the next configuration's engine is built
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "dsv3"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--nextn", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = 1000 if args.model == "tiny" else DSV3_SHAPED["vocab_size"] - 1
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if args.model == "dsv3":
            (Path(tmp) / "config.json").write_text(json.dumps(DSV3_SHAPED))
            path = tmp
        rows = [measure(args, n, path, prompts) for n in args.nextn]
    base = rows[0]["outputs"] if rows[0]["nextn"] == 0 else None
    for r in rows:
        same = "" if base is None else f"  outputs {'==' if r['outputs'] == base else '!='} nextn 0"
        acc = (
            ""
            if "acceptance" not in r
            else f"  acceptance {r['acceptance']:.1%} per position " + " ".join(f"{p:.1%}" for p in r["per_position"])
        )
        print(f"nextn {r['nextn']}: {r['tokens_per_s']:8.1f} tokens/s ({r['seconds']:.2f} s){acc}{same}")


if __name__ == "__main__":
    main()
