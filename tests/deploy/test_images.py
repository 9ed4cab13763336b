"""The images (not built here: no registry): both Dockerfiles lint clean with hadolint, parse, run
as a non-root user with the health probe, copy only what exists and what their ignore files let
through, and pin the versions `make install` and the chart use. The health probe answers a real
HTTP server."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading

import pytest
import yaml

from tests.deploy.chart import CHART, ROOT

DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in (ROOT / "deploy" / name).read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def args_of(name: str) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions(name) if k == "ARG" and "=" in a)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (make install: dev extras)")
    r = subprocess.run([hadolint, str(ROOT / "deploy" / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_unprivileged_with_the_health_probe(name):
    steps = instructions(name)
    kinds = [k for k, _ in steps]
    assert kinds.count("FROM") == 2 and kinds[-1] == "CMD"
    final = steps[len(steps) - 1 - kinds[::-1].index("FROM") :]  # the last stage: what ships
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = next(a for k, a in final if k == "HEALTHCHECK")
    assert "deepinfer-healthcheck" in health and "/health" in health
    assert set(next(a for k, a in final if k == "EXPOSE").split()) == {"8000", "50051"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_source_exists_and_is_let_through(name):
    ignore = (ROOT / "deploy" / f"{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, arguments in instructions(name):
        if keyword != "COPY" or "--from=" in arguments:
            continue
        sources = [a for a in arguments.split() if not a.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is not in {name}.dockerignore's exceptions"
    packages = re.search(r"include = \[(.*?)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):  # every package the wheel holds goes into the image
        assert package in allowed, package


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_builds_the_fast_lanes_extension_or_fails(name):
    """A C compiler in the build stage, and the install told that the extension must build: an
    image that fell back to the Python lane would serve at twice the head's CPU a token."""
    steps = instructions(name)
    starts = [i for i, (k, _) in enumerate(steps) if k == "FROM"]
    build = steps[starts[0] : starts[1]]
    assert any(k == "RUN" and "apt-get install" in a and " gcc " in f" {a} " for k, a in build)
    installs = [a for k, a in build if k == "RUN" and a.endswith("pip install --no-cache-dir .")]
    assert installs == ["DEEPINFER_REQUIRE_NATIVE=1 pip install --no-cache-dir ."]
    assert "setup.py" in next(a for k, a in build if k == "COPY" and "pyproject.toml" in a)


def test_the_images_pin_what_make_install_and_the_chart_use():
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r'"torch==([0-9.]+)"', makefile).group(1)
    ray = yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]
    nixl_floor = re.search(r'"nixl>=([0-9.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    for name in DOCKERFILES:
        args = args_of(name)
        assert args["TORCH_VERSION"] == torch, name
        assert args["RAY_VERSION"] == ray, name
        assert tuple(map(int, args["NIXL_VERSION"].split("."))) >= tuple(map(int, nixl_floor.split("."))), name
    assert args_of("Dockerfile")["NIXL_VARIANT"].startswith("cu")  # NIXL's CUDA wheel
    assert args_of("Dockerfile")["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert args_of("Dockerfile.cpu")["TORCH_INDEX_URL"].endswith("/cpu")


class _Health(http.server.BaseHTTPRequestHandler):
    ready = False

    def do_GET(self):  # noqa: N802 (the standard library's name)
        body = json.dumps({"status": "ok" if self.ready else "starting", "detail": "waiting for decode"}).encode()
        self.send_response(200 if self.ready else 503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_health_probe_follows_the_gateway_s_health():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/health"
    probe = [sys.executable, str(ROOT / "deploy" / "healthcheck.py"), url]
    try:
        starting = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        _Health.ready = True
        ready = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert starting.returncode == 1 and "waiting for decode" in starting.stderr
    assert ready.returncode == 0
    gone = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1
