"""The router's per-token work on a sample's deltas, alone: `SampleProgress.place` (what the client
has, for migration) then `SampleAssembler.push` (what it may see), one token of 4 characters a
delta, for outputs of 64 to 32,768 tokens, without and with a stop string's holdback.

A cost per token that grows with the output's length would be a copy of the text so far per
token; it should stay flat.

    python -m benchmarks.router_assembly [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

from deepinfer_core.sampling_params import SamplingParams
from services.common.deltas import SampleAssembler, SampleDelta
from services.router.migration import SampleProgress

LENGTHS = (64, 2048, 32768)


def us_per_token(num_tokens: int, holdback: int) -> float:
    progress, assembler = SampleProgress([1, 2, 3], SamplingParams()), SampleAssembler(0, holdback)
    deltas = [SampleDelta(token_offset=i, token_ids=[i], text_offset=4 * i, text="abc ") for i in range(num_tokens)]
    place, push = progress.place, assembler.push
    started = time.perf_counter()
    for d in deltas:
        push(place(d))
    return (time.perf_counter() - started) / num_tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs per cell; the fastest is reported")
    args = parser.parse_args()
    print("| output tokens | µs/token, no holdback | µs/token, holdback 4 |\n|---:|---:|---:|")
    rows = {n: [min(us_per_token(n, h) for _ in range(args.repeat)) for h in (0, 4)] for n in LENGTHS}
    for n, (plain, held) in rows.items():
        print(f"| {n:,} | {plain:.2f} | {held:.2f} |")
    longest, shortest = rows[LENGTHS[-1]], rows[LENGTHS[0]]
    print(f"\n{LENGTHS[-1]:,} vs {LENGTHS[0]} tokens: {longest[0] / shortest[0]:.2f}x, {longest[1] / shortest[1]:.2f}x")


if __name__ == "__main__":
    main()
