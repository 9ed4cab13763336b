"""The `deepinfer` command line, run as a real subprocess."""

import subprocess
import sys

from deepinfer_core import LLM, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_the_completion_of_the_embedded_model():
    r = _cli("generate", "Hello, my name is", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    llm = LLM(max_model_len=4096, num_gpu_blocks=64)
    want = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert r.stdout == f"Hello, my name is{want}\n"


def test_generate_reports_bad_input_without_a_traceback():
    r = _cli("generate", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "x", "--model", "/no/such/dir")
    assert r.returncode == 2 and "/no/such/dir" in r.stderr
