"""A process that made a NIXL agent maps one libibverbs and exits cleanly, also on a host with the
RDMA packages installed (libibverbs1, ibverbs-providers; CI installs them): UCX's EFA module, which
links the system's libibverbs beside the wheel's own, is kept out, and an operator's choice wins."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

ROOT = Path(__file__).resolve().parents[2]
_MAKE_AGENT = """
import os, torch
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.nixl_agent import NixlKVAgent
buf = torch.zeros(2, 8, 4, 2)
agent = NixlKVAgent("exit", buf, KVLayout.of({"architectures": ["Exit"]}, buf, 4), sends=True)
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libibverbs" in line}
print("IBVERBS", len(maps), "MODULES", os.environ.get("UCX_MODULES"))
"""


def _run(env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    env = {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-c", _MAKE_AGENT]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_an_agent_process_maps_one_libibverbs_and_exits_cleanly():
    out = _run({})
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("IBVERBS"))
    assert line.split()[1] in ("0", "1") and line.endswith("MODULES ^efa"), line


def test_an_operator_s_ucx_modules_win():
    out = _run({"UCX_MODULES": "^efa,cma"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MODULES ^efa,cma" in out.stdout
