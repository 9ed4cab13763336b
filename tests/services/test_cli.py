"""The `deepinfer` command line, run as a real subprocess."""

import asyncio
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


def _serve_config(argv: list[str], monkeypatch, env: dict[str, str]):
    import argparse

    from services.cli import serve

    for name in ("DEEPINFER_API_KEYS", "DEEPINFER_CLUSTER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="WARNING")
    serve.add_parser(parser.add_subparsers())
    return serve.config_from_args(parser.parse_args(["serve", "--gpus-per-worker", "0", *argv]))


def test_serve_takes_api_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nk3\n\n  k4 \nk1\n")
    argv = ["--api-key", "k1", "--api-key", "k2", "--api-key-file", str(keys)]
    config = _serve_config(argv, monkeypatch, {"DEEPINFER_API_KEYS": "k5, k6,,"})
    assert config.api_keys == ("k1", "k2", "k3", "k4", "k5", "k6")
    assert config.gateway_config().api_keys == config.api_keys
    assert "k1" not in repr(config) and "k1" not in repr(config.gateway_config())  # never in a log line
    assert _serve_config([], monkeypatch, {}).api_keys == ()


def test_serve_makes_a_cluster_token_per_cluster_unless_given(monkeypatch):
    made = [_serve_config([], monkeypatch, {}).cluster_token for _ in range(2)]
    assert made[0] != made[1] and min(map(len, made)) >= 32
    assert _serve_config([], monkeypatch, {"DEEPINFER_CLUSTER_TOKEN": "env-t"}).cluster_token == "env-t"
    config = _serve_config(["--cluster-token", "flag-t"], monkeypatch, {"DEEPINFER_CLUSTER_TOKEN": "env-t"})
    assert config.cluster_token == "flag-t" and config.pool_spec().cluster_token == "flag-t"
    assert "flag-t" not in repr(config) and "flag-t" not in repr(config.pool_spec())
    assert not config.internal_reflection and not config.pool_spec().reflection


def test_serve_refuses_tls_settings_that_make_no_server(tmp_path, monkeypatch):
    import pytest

    with pytest.raises(ValueError, match="--ssl-certfile"):
        _serve_config(["--ssl-ca-certs", str(tmp_path / "ca.pem")], monkeypatch, {})
    with pytest.raises(FileNotFoundError):
        _serve_config(["--ssl-certfile", str(tmp_path / "missing.pem")], monkeypatch, {})


def test_serve_refuses_an_ep_size_the_model_cannot_split_before_starting_anything(tmp_path):
    r = _cli("serve", "--decode-ep", "3")  # the embedded model has 8 routed experts
    assert r.returncode == 2 and "--decode-ep 3" in r.stderr and "must divide the 8 routed experts" in r.stderr
    assert "Traceback" not in r.stderr and "Ray" not in r.stdout
    from tests.helpers.hf_models import tiny_hf_config

    tiny_hf_config("llama").save_pretrained(tmp_path)
    r = _cli("serve", "--model", str(tmp_path), "--prefill-ep", "2")
    assert r.returncode == 2 and "needs a mixture-of-experts model" in r.stderr, r.stderr


def test_serve_passes_the_balancer_settings_to_every_engine(monkeypatch):
    argv = ["--decode-ep", "3", "--redundant-experts", "1", "--enable-eplb", "--eplb-interval", "500",
            "--moe-dispatch", "padded"]  # fmt: skip
    config = _serve_config(argv, monkeypatch, {})  # 8 experts + 1 redundant slot split over 3 ranks
    assert config.ep_sizes == {3: 3}
    eplb = config.engine_args.eplb
    assert (eplb.enabled, eplb.num_redundant_experts, eplb.rearrange_interval) == (True, 1, 500)
    assert config.engine_args.to_engine_args(EngineType.COMPLETION).eplb == eplb
    assert config.engine_args.to_engine_args(EngineType.COMPLETION).moe_dispatch == "padded"


def test_serve_passes_the_stream_interval_to_every_decode_worker(monkeypatch):
    from types import SimpleNamespace

    import pytest

    from services.common.workers import POOL_DECODE
    from services.controller.controller import ClusterController
    from services.workers.roles import worker_role

    config = _serve_config(["--stream-interval", "4"], monkeypatch, {})
    assert config.stream_interval == 4 and config.pool_spec().stream_interval == 4
    spec = ClusterController._worker_spec(
        SimpleNamespace(spec=config.pool_spec(), router_address=""), "d-0", POOL_DECODE
    )
    assert spec.stream_interval == 4
    from benchmarks.token_source import TokenSourceEngine, token_source_config

    async def streams_of_a_core():  # a core takes its event loop when it is made
        return worker_role(spec.pool).make_core(TokenSourceEngine(token_source_config()), spec).streams

    assert asyncio.run(streams_of_a_core()).stream_interval == 4
    assert _serve_config([], monkeypatch, {}).pool_spec().stream_interval == 1
    with pytest.raises(ValueError, match="--stream-interval must be at least 1"):
        _serve_config(["--stream-interval", "0"], monkeypatch, {})
