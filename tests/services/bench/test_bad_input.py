"""`deepinfer bench serve` on bad input: a clear message, what was measured saved, a non-zero exit."""

import json
import socket

import pytest

from services.cli.main import main
from tests.services.bench.fake_openai import MODEL, Behaviour, FakeServer

SMALL = ["--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def bench(*args: str) -> int:
    return main(["bench", "serve", *args])


def test_unreachable_url(free_port, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port}"
    assert (
        bench("--base-url", url, "--model", "m", *SMALL, "--result-filename", "r.json", "--result-dir", str(tmp_path))
        == 1
    )
    err = capsys.readouterr().err
    assert "cannot connect" in err and url in err
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 0 and "cannot connect" in saved["aborted"]
    assert bench("--base-url", url, *SMALL) == 1  # no --model: the model list cannot be read either
    assert "cannot read the models" in capsys.readouterr().err


def test_wrong_model_names_what_the_server_serves(capsys):
    server = FakeServer()
    try:
        assert bench("--base-url", server.url, "--model", "nope", *SMALL) == 1
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "'nope'" in err and MODEL in err


def test_errors_mid_run_keep_the_partial_result(tmp_path, capsys):
    server = FakeServer(Behaviour(fail_after=6))  # the test request and 5 measured ones succeed
    try:
        args = ["--base-url", server.url, *SMALL, "--max-concurrency", "1", "--save-result"]
        assert bench(*args, "--result-filename", "partial.json", "--result-dir", str(tmp_path)) == 1
    finally:
        server.stop()
    assert "7 of 12 requests failed: 7 x HTTP 500: engine crashed" in capsys.readouterr().err
    saved = json.loads((tmp_path / "partial.json").read_text())
    assert (saved["completed"], saved["failed"]) == (5, 7)
    assert saved["errors"][:5] == [""] * 5 and saved["errors"][5] == "HTTP 500: engine crashed"
    assert saved["failure_reasons"] == {"HTTP 500: engine crashed": 7}
    assert saved["total_output_tokens"] == 5 * 4 and saved["mean_ttft_ms"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset-name", "sharegpt", "--dataset-path", "BAD"], "not a valid JSON file"),
        (["--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["--goodput", "ttft=5"], "--goodput"),
        (["--endpoint", "/v1/embeddings"], "--endpoint"),
        (["--extra-body", "[1]"], "--extra-body"),
    ],
)
def test_bad_arguments_and_malformed_datasets_exit_2_before_sending(tmp_path, capsys, free_port, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text("[{broken")
    args = [str(bad) if a == "BAD" else a for a in args]
    assert bench("--base-url", f"http://127.0.0.1:{free_port}", "--model", "m", *SMALL, *args) == 2
    assert message in capsys.readouterr().err
