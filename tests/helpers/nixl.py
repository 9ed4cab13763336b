"""The NIXL build of the test process, through `nixl_variant` (never the meta package's `import
nixl`, which could bind a build other than the one the code under test picks)."""

from __future__ import annotations

import pytest

from deepinfer_core.transfer import nixl_variant


def require_nixl():
    """The chosen build's `_api`; skips the calling module when no build imports."""
    try:
        return nixl_variant.api()
    except ImportError as e:
        pytest.skip(f"nixl is not importable: {e}", allow_module_level=True)


def obj_plugin_problem() -> str | None:
    """Why NIXL's OBJ (S3) plugin cannot load in this process (None: it loads)."""
    try:
        name = nixl_variant.chosen()
    except ImportError as e:
        return f"nixl is not importable: {e}"
    ok, why = nixl_variant.plugins_load(name, ("OBJ",))
    return None if ok else f"NIXL's OBJ plugin does not load here ({why})"
