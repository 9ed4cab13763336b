"""`deepinfer generate PROMPT...`: offline generation, printing each completion."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions offline (no server)")
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer_core import LLM, SamplingParams

    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in args.prompts]
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        for sample in out.outputs:
            print(f"{prompt}{sample.text}")
    return 0
