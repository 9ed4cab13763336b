"""One NIXL build per process: the pick is made once, every NIXL user (and `import nixl._api`) gets
it, processes started afterwards inherit it, and a forced build that is not there is refused."""

import os
import subprocess
import sys

import pytest

from deepinfer_core.transfer import nixl_variant

if not nixl_variant.installed():
    pytest.skip("no NIXL build is installed", allow_module_level=True)

_SHOW = (
    "import os\n"
    "from deepinfer_core.transfer import nixl_variant as v\n"
    "api = v.api()\n"
    "import nixl._api\n"
    "print(v.chosen(), api.__name__, nixl._api.__name__, os.environ[v.ENV])\n"
)


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != nixl_variant.ENV}, **env}
    return subprocess.run([sys.executable, "-c", _SHOW], capture_output=True, text=True, timeout=120, env=env)


def test_a_process_picks_one_build_whose_plugins_load_and_passes_it_on():
    done = _run({})
    assert done.returncode == 0, done.stderr[-2000:]
    name, api, aliased, exported = done.stdout.splitlines()[-1].split()
    assert api == aliased == f"{name}._api" and exported == name  # `import nixl._api` is not a second build
    if nixl_variant._cuda_major() is None:
        loads = [v for v in nixl_variant.installed() if nixl_variant.plugins_load(v, nixl_variant.PLUGINS)[0]]
        assert name == (loads or nixl_variant.installed())[0]


def test_a_forced_build_is_used_or_refused_by_name():
    forced = nixl_variant.installed()[-1]
    done = _run({nixl_variant.ENV: forced})
    assert done.returncode == 0 and done.stdout.splitlines()[-1].split()[0] == forced
    refused = _run({nixl_variant.ENV: "nixl_cu99"})
    assert refused.returncode != 0 and "DEEPINFER_NIXL_VARIANT='nixl_cu99': choose one of" in refused.stderr
