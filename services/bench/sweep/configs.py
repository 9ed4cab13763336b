"""Configuration names of a sweep and the `deepinfer serve` flags each one stands for."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PD = re.compile(r"(\d+)p(\d+)d((?:-cond|-nostore)*)")
_COLOCATED = re.compile(r"colocated(\d*)")


@dataclass(frozen=True)
class ServeConfig:
    name: str
    """As given to --configs: `colocated`, `colocated2`, `1p1d`, `2p1d`, ..."""
    serve_args: tuple[str, ...]
    """The flags of `deepinfer serve` that make this configuration."""


def parse_config(name: str) -> ServeConfig:
    """`colocated[N]`: N NORMAL engines (default 1); `XpYd`: X prefill and Y decode engines, every
    prompt through a PE; suffixes: `-cond` conditional disaggregation (short prompts prefilled on
    the CE, `deepinfer serve`'s default), `-nostore` no KV store under the engines."""
    name = name.strip().lower()
    colocated = _COLOCATED.fullmatch(name)
    if colocated:
        return ServeConfig(name, ("--colocated", "--decode", colocated.group(1) or "1"))
    pd = _PD.fullmatch(name)
    if pd and int(pd.group(1)) > 0 and int(pd.group(2)) > 0:
        args = ["--prefill", pd.group(1), "--decode", pd.group(2)]
        suffixes = pd.group(3)
        if "-cond" not in suffixes:
            args += ["--local-prefill-tokens", "0"]
        if "-nostore" in suffixes:
            args += ["--no-kv-store"]
        return ServeConfig(name, tuple(args))
    raise ValueError(
        f"--configs: unknown configuration {name!r}; expected colocated, colocatedN or XpYd[-cond][-nostore] (e.g. 2p1d)"
    )


def parse_configs(text: str) -> list[ServeConfig]:
    names = [n for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--configs: name at least one configuration, e.g. colocated,1p1d")
    configs = [parse_config(n) for n in names]
    if len({c.name for c in configs}) != len(configs):
        raise ValueError(f"--configs {text!r}: a configuration is named twice")
    return configs
