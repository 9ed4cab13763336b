"""Check and time the kernels.

    python -m benchmarks.kernel_bench --check            # every kernel vs its reference (CPU: TRITON_INTERPRET=1)
    python -m benchmarks.kernel_bench                    # GPU: time the target shapes, print a table per kernel
    python -m benchmarks.kernel_bench --sweep [KERNEL..] # GPU: also time candidate tile configs / split counts
    python -m benchmarks.kernel_bench --json out.json    # write every number too
    python -m benchmarks.kernel_bench --engine [--preset qwen3-30b-a3b|tiny] [--layers N] [--batch 64]
        [--context 4096] [--prefill-tokens 8192] [--new-tokens 32] [--zos both|on|off] [--no-hf]
                                                         # a whole engine decode step (ZOS on/off: step
                                                         # time, GPU idle between steps, bytes touched /
                                                         # step time / copy bandwidth), a prefill, and
                                                         # tokens/s vs transformers generate on the same
                                                         # random weights (engine_run.py; CPU: --preset tiny)

Timings are the median of three medians of CUDA-event timings, each run after L2 is emptied by
reading a 256 MB buffer (`--flush memset`: `triton.testing.do_bench`'s zeroing, which leaves dirty
lines for the op to write back; see `timing.cold_ms`), after 250 ms of warm-up.
Floors: bytes that must move / measured copy bandwidth, FLOPs / measured bf16 matmul rate;
`floor/time` is the fraction of the better of the two limits reached.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch


def _check(args: argparse.Namespace) -> int:
    from benchmarks.kernel_bench.checks import run_checks

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run the checks through the interpreter, TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    device = torch.device("cuda" if cuda else "cpu")
    results = run_checks(device, seed, small=not cuda, only=args.only)
    print(f"check on {device} ({'Triton' if cuda else 'Triton interpreter'}), seed {seed}")
    for r in results:
        print(f"  {'PASS' if r.ok else 'FAIL'}  {r.kernel:<24} {r.case:<58} err {r.error:.2e} (tol {r.tol:.0e})")
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} passed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "ok": r.ok} for r in results], f, indent=1)
    return 1 if failed else 0


def _time(args: argparse.Namespace) -> int:
    from benchmarks.kernel_bench.timing import run_timings

    if not torch.cuda.is_available():
        print("timings need a GPU; on CPU run --check with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    sweep = None if args.sweep is None else (args.sweep or ["all"])
    rows, ceilings = run_timings(sweep=sweep, only=args.only, flush=args.flush)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows}, f, indent=1)
    return 0


def _engine(args: argparse.Namespace) -> int:
    from benchmarks.kernel_bench.engine_run import main as engine_main

    return engine_main(args)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.kernel_bench.engine_spec import add_arguments as add_engine_arguments

    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_bench", description=__doc__.split("\n")[0])
    p.add_argument("--engine", action="store_true", help="time whole engine steps (decode, prefill) and generate")
    p.add_argument("--check", action="store_true", help="compare every kernel with its reference")
    p.add_argument("--sweep", nargs="*", help="time the candidate tile configs too (of these kernels; none named: all)")
    p.add_argument("--only", nargs="*", help="kernel names to run (default: all)")
    p.add_argument("--flush", choices=("read", "memset"), default="read",
                   help="how L2 is emptied before each timed run (default: read a 256 MB buffer)")  # fmt: skip
    p.add_argument("--seed", type=int, help="input seed for --check (default: random, printed)")
    p.add_argument("--cpu", action="store_true", help="check (or run --engine) on CPU even when a GPU is present")
    p.add_argument("--json", help="write the results to this file")
    add_engine_arguments(p)
    args = p.parse_args(argv)
    if args.engine:
        return _engine(args)
    return _check(args) if args.check else _time(args)
