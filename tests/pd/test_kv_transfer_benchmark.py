"""benchmarks/kv_transfer.py runs on CPU (DRAM -> DRAM over UCX loopback) and prints its tables:
the hand-off table and the posting breakdown, each with one row per block size and length."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_transfer.py"


def _rows(*flags: str) -> list[list[str]]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--lengths", "64", "--block-sizes", "16", "--reps", "1", *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    return [cells for cells in lines if cells and cells[0] == "16"]


@pytest.mark.parametrize(
    "flags, columns",
    [((), 12), (("--posting",), 9)],
    ids=["hand-offs", "posting"],
)
def test_the_benchmark_prints_a_row_per_block_size_and_length(flags, columns):
    (row,) = _rows(*flags)
    assert len(row) == columns and row[:2] == ["16", "64"]
    # 64 tokens = 4 blocks of 16 x 16 layers x 8 KV heads x 128 dims x K,V x 4 bytes (fp32 on CPU)
    assert float(row[2]) == pytest.approx(4 * 16 * 16 * 8 * 128 * 2 * 4 / 2**20, abs=0.05)
    ratios = [float(c.rstrip("%")) for c in row[3:]]
    assert all(r > 0 for r in ratios)
