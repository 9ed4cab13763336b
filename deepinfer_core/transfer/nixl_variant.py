"""Which NIXL build this process uses: one of the `nixl_cu12` / `nixl_cu13` wheels, picked once.

The `nixl` meta package installs both and imports one by the CUDA major of the process's torch,
else the first installed (cu13). Both builds bind the same C++ types, so a process can import
only one of them, and every NIXL user in it (P/D agents, the KV store's storage backends, the
embedding pool) must share it. Without CUDA the meta package's choice can be a build whose plugins
do not all load: cu13's OBJ (S3) plugin links a CUDA 13 cuObject library that a CPU host lacks,
while cu12's loads. So the pick is:

1. the build already imported in this process (by the meta package's `import nixl`, say);
2. `DEEPINFER_NIXL_VARIANT` (e.g. `nixl_cu12`) when set;
3. a CUDA torch: the build of its CUDA major, as the meta package does (GPU hosts are unchanged);
4. no CUDA: the first installed build whose plugins `PLUGINS` all load, else the first whose
   `BASE_PLUGINS` load, else the first installed. "Load" is checked in a child process
   (`ctypes` opening each plugin library) so that a failed try leaves nothing behind in this one.

The choice is exported as `DEEPINFER_NIXL_VARIANT` for the processes this one starts (engines,
Ray workers), so that they pick the same build without probing again. `api()` is the chosen
build's `_api` module; `nixl._api` is pointed at it too, so code that says
`import nixl._api` gets the same build instead of the meta package importing a second one.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
from functools import lru_cache
from types import ModuleType
from typing import Optional

logger = logging.getLogger(__name__)

ENV = "DEEPINFER_NIXL_VARIANT"
VARIANTS = ("nixl_cu13", "nixl_cu12")
"""In the meta package's order of preference."""
BASE_PLUGINS = ("UCX", "POSIX")
"""What P/D transfers and the file tier use."""
PLUGINS = (*BASE_PLUGINS, "OBJ")
"""Every plugin DeepInfer can use (OBJ: the KV store on an S3-compatible bucket)."""
_PROBE_TIMEOUT_S = 30.0


class NixlUnavailable(ImportError):
    pass


def installed() -> list[str]:
    return [name for name in VARIANTS if importlib.util.find_spec(name) is not None]


def plugin_dir(variant: str) -> Optional[str]:
    """Where a build's plugin libraries are (None: not where its wheel puts them)."""
    spec = importlib.util.find_spec(variant)
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    for candidate in (
        os.path.join(site, f".{variant}.mesonpy.libs", "plugins"),
        os.path.join(site, f"{variant}.libs", "nixl"),
    ):
        if os.path.isdir(candidate):
            return candidate
    return None


def plugins_load(variant: str, plugins: tuple[str, ...]) -> tuple[bool, str]:
    """Whether each of `plugins` of `variant` opens with its dependencies (checked in a child
    process); the second item is the loader's error when one does not."""
    directory = plugin_dir(variant)
    if directory is None:
        return True, "plugin directory not found (assumed loadable)"
    paths = [os.path.join(directory, f"libplugin_{p}.so") for p in plugins]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return False, f"{variant} has no {', '.join(os.path.basename(p) for p in missing)}"
    code = "import ctypes, os, sys\nfor p in sys.argv[1:]:\n    ctypes.CDLL(p, mode=os.RTLD_LOCAL)\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"probing {variant}'s plugins failed: {e}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return False, f"{variant}: {lines[-1] if lines else 'plugin failed to load'}"
    return True, ""


def _cuda_major() -> Optional[int]:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return int(version.split(".")[0]) if version else None


@lru_cache(maxsize=1)
def chosen() -> str:
    """The module name of this process's NIXL build (decided once)."""
    for name in VARIANTS:
        if name in sys.modules:
            return name
    names = installed()
    forced = os.environ.get(ENV)
    if forced:
        if forced not in VARIANTS:
            raise NixlUnavailable(f"{ENV}={forced!r}: choose one of {', '.join(VARIANTS)}")
        if forced not in names:
            raise NixlUnavailable(f"{ENV}={forced}, but {forced} is not installed")
        return forced
    if not names:
        raise NixlUnavailable(f"no NIXL build is installed (pip install nixl: one of {', '.join(VARIANTS)})")
    major = _cuda_major()
    if major is not None:
        name = f"nixl_cu{major}"
        if name not in names:
            raise NixlUnavailable(f"torch uses CUDA {major} but {name} is not installed")
        return name
    if len(names) == 1:
        return names[0]
    for wanted in (PLUGINS, BASE_PLUGINS):
        for name in names:
            ok, why = plugins_load(name, wanted)
            if ok:
                return name
            logger.info("NIXL build %s skipped: %s", name, why)
    return names[0]


def api() -> ModuleType:
    """The chosen build's `_api` module (`nixl_agent`, `nixl_agent_config`, `nixlBind`)."""
    name = chosen()
    os.environ.setdefault(ENV, name)
    module = importlib.import_module(f"{name}._api")
    if "nixl" not in sys.modules:  # `import nixl._api` elsewhere gets this build, not a second one
        sys.modules["nixl"] = importlib.import_module(name)
        sys.modules["nixl._api"] = module
    return module
