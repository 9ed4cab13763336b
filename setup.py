"""The compiled part of the service layer (`services/native/`); everything else is in pyproject.toml.

`optional`: where no C compiler is found, the install goes on without it and the Python it stands
in for runs instead (`services/native/__init__.py`)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "services.native._delta_lane",
            ["services/native/delta_lane.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        )
    ]
)
