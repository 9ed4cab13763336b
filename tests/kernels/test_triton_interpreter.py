"""Every Triton kernel against its torch reference on CPU, through the Triton interpreter.

`TRITON_INTERPRET=1` must be set before triton is imported, so the checks run in a child
process (`python -m benchmarks.kernel_bench --check`) with random odd-sized inputs; each kernel's cases
are then asserted here one test per kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8):
    # 3.6's interpreter fails on loops bounded by loaded values (`range(start, seq_len, ...)`); the
    # compiled kernels are checked against the same references on a GPU (test_cuda_kernels.py)
    pytest.skip("this triton's interpreter cannot run the kernels' data-dependent loops", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
KERNELS = [
    "rms_norm",
    "rotary",
    "reshape_and_cache",
    "copy_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "mla_decode_attention",
    "moe_topk",
    "moe_align",
    "fused_experts",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("interp") / "check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_bench", "--check", "--cpu", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stdout + proc.stderr
    by_kernel: dict[str, list[dict]] = {}
    for r in json.loads(out.read_text()):
        by_kernel.setdefault(r["kernel"], []).append(r)
    by_kernel["_log"] = proc.stdout + proc.stderr
    return by_kernel


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_reference_in_interpreter(results, kernel: str) -> None:
    cases = results.get(kernel)
    assert cases, f"no check ran for {kernel}:\n{results['_log']}"
    failed = [c for c in cases if not c["ok"]]
    assert not failed, f"{kernel}: {failed}\n{results['_log']}"


def test_every_checked_kernel_is_listed(results) -> None:
    assert set(results) - {"_log"} == set(KERNELS)
