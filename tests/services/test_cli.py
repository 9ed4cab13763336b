"""The `deepinfer` command line, run as a real subprocess."""

import subprocess
import sys

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.roles import EngineType


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


def test_serve_refuses_an_ep_size_the_model_cannot_split_before_starting_anything(tmp_path):
    r = _cli("serve", "--decode-ep", "3")  # the embedded model has 8 routed experts
    assert r.returncode == 2 and "--decode-ep 3" in r.stderr and "must divide the 8 routed experts" in r.stderr
    assert "Traceback" not in r.stderr and "Ray" not in r.stdout
    from tests.helpers.hf_models import tiny_hf_config

    tiny_hf_config("llama").save_pretrained(tmp_path)
    r = _cli("serve", "--model", str(tmp_path), "--prefill-ep", "2")
    assert r.returncode == 2 and "needs a mixture-of-experts model" in r.stderr, r.stderr


def test_serve_passes_the_balancer_settings_to_every_engine():
    import argparse

    from services.cli import serve

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="warning")
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--decode-ep", "3", "--redundant-experts", "1", "--enable-eplb",
                              "--eplb-interval", "500"])  # fmt: skip
    config = serve.config_from_args(args)  # 8 experts + 1 redundant slot split over 3 ranks
    assert config.ep_sizes == {3: 3}
    eplb = config.engine_args.eplb
    assert (eplb.enabled, eplb.num_redundant_experts, eplb.rearrange_interval) == (True, 1, 500)
    assert config.engine_args.to_engine_args(EngineType.COMPLETION).eplb == eplb
