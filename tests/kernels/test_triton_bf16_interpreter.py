"""bf16 Triton kernels against the model's CPU (torch) path, in the interpreter with the GPU's bf16
arithmetic (`tests.helpers.triton_bf16`): the same roundings, so at most rare last-bit differences.

The fp32 interpreter checks (`test_triton_interpreter.py`) cannot see a kernel that rounds in a
different order than the model's torch path; in bf16 that moves an MoE model off HF's numerics
(the fused-MoE kernel once kept silu(gate) * up in fp32: two thirds of its bf16 outputs differed).
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


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("bf16") / "checks.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.triton_bf16", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    if not report["patched"]:
        pytest.skip("this triton's interpreter has no hooks for GPU bf16 arithmetic")
    return report["results"]


@pytest.mark.parametrize(
    "check",
    [
        "rms_norm",
        "rms_norm +residual",
        "rotary",
        "fused_experts vs the model's torch path",
        "fused_experts vs fused_experts_ref",
    ],
)
def test_bf16_kernel_rounds_as_the_torch_path(checks, check: str) -> None:
    (result,) = [r for r in checks if r["check"] == check]
    assert result["ok"], result
