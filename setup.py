"""The compiled part of the service layer (`services/native/`); everything else is in pyproject.toml.

Where no C compiler is found, the install goes on without it and the Python it stands in for runs
instead (`services/native/__init__.py`). `DEEPINFER_REQUIRE_NATIVE=1` makes its build a must (the
images set it: a build that silently fell back would serve at twice the head's CPU a token)."""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "services.native._delta_lane",
            ["services/native/delta_lane.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=os.environ.get("DEEPINFER_REQUIRE_NATIVE", "0") != "1",
        )
    ]
)
