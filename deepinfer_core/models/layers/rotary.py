"""Rotary position embedding (RoPE), neox style, with the scaling variants HF checkpoints use.

Frequencies are computed once per model into a cos/sin table (fp32, with the attention factor
folded in, as HF does) and looked up by each token's position. A flat batch that mixes prefill
chunks and decode tokens of many sequences therefore needs no per-step recomputation.

Supported `rope_type`s: "default", "linear", "dynamic" (NTK), "llama3", "yarn". Their inverse
frequencies follow transformers' `ROPE_INIT_FUNCTIONS` (tests compare them). Dynamic NTK is the
one type whose frequencies depend on the sequence length: positions below
`max_position_embeddings` use the unscaled base, exactly as HF does for sequences within that
length; position p beyond it uses the base HF computes for a length of p + 1, which is what HF's
own KV-cached generation applies to that token (cached keys are never re-rotated).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer_kernels import ops
from deepinfer_kernels.registry import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DEFAULT_THETA = 10000.0


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict with `rope_type` and `rope_theta` filled in.

    Reads the transformers-5 `rope_parameters` key and the legacy `rope_scaling` key (whose
    type is named `rope_type` or `type`); legacy wins where both set a field, like HF.
    """
    params = {**(hf_config.get("rope_parameters") or {}), **(hf_config.get("rope_scaling") or {})}
    legacy_type = params.pop("type", None)
    params["rope_type"] = params.get("rope_type") or legacy_type or "default"
    params["rope_theta"] = float(params.get("rope_theta") or hf_config.get("rope_theta") or _DEFAULT_THETA)
    if params["rope_type"] in ("llama3", "yarn"):
        original = hf_config.get("original_max_position_embeddings")  # Phi-3 style top-level key wins
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    return params


def _check_type(rope_type: str) -> None:
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _exponents(dim: int) -> torch.Tensor:  # [dim/2]: 2i/dim
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(params: dict[str, Any], dim: int) -> torch.Tensor:  # [dim/2]
    return 1.0 / (params["rope_theta"] ** _exponents(dim))


def _linear(params: dict[str, Any], dim: int) -> torch.Tensor:
    return _default(params, dim) / params["factor"]


def _dynamic_base(params: dict[str, Any], dim: int, seq_len: float, max_pos: int) -> float:
    factor = params["factor"]
    seq_len = max(seq_len, max_pos)
    return params["rope_theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def _llama3(params: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _default(params, dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_correction_range(params: dict[str, Any], dim: int) -> tuple[float, float]:
    """Dimensions below `low` keep their frequency, above `high` are interpolated fully."""
    base, original = params["rope_theta"], params["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(params.get("beta_fast") or 32), dim_for(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(params: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_pos / params["original_max_position_embeddings"]
    pos_freqs = params["rope_theta"] ** _exponents(dim)  # [dim/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(params, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, _yarn_attention_factor(params, factor)


def rope_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and attention factor, as HF's RoPE init functions give.

    `seq_len` only matters for "dynamic" (the sequence length the frequencies are for).
    """
    rope_type = params["rope_type"]
    _check_type(rope_type)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embedding is not supported ({params['partial_rotary_factor']=})")
    if rope_type == "yarn":
        return _yarn(params, head_dim, max_position_embeddings)
    if rope_type == "dynamic":
        base = _dynamic_base(params, head_dim, seq_len or max_position_embeddings, max_position_embeddings)
        return _default({"rope_theta": base}, head_dim), 1.0
    compute = {"default": _default, "linear": _linear, "llama3": _llama3}[rope_type]
    return compute(params, head_dim), 1.0


def rope_max_positions(params: dict[str, Any], max_position_embeddings: int) -> int:
    """Longest context the scaled RoPE is meant for: the length of the cos/sin table."""
    rope_type, factor = params["rope_type"], params.get("factor") or 1.0
    if rope_type in ("linear", "dynamic"):
        return max(max_position_embeddings, int(max_position_embeddings * factor))
    if rope_type in ("llama3", "yarn"):
        return max(max_position_embeddings, int(params["original_max_position_embeddings"] * factor))
    return max_position_embeddings


def _dynamic_tail(params: dict[str, Any], dim: int, max_pos: int, max_positions: int) -> torch.Tensor:
    """Angles [max_positions - max_pos, dim/2] of positions past `max_pos`, each with its own base."""
    positions = torch.arange(max_pos, max_positions, dtype=torch.float32)
    bases = torch.tensor(
        [_dynamic_base(params, dim, p + 1, max_pos) for p in range(max_pos, max_positions)],
        dtype=torch.float32,
    )
    inv_freq = 1.0 / (bases[:, None] ** _exponents(dim)[None, :])  # [P, dim/2]
    return positions[:, None] * inv_freq


def rope_cos_sin_table(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, max_positions: int
) -> torch.Tensor:
    """fp32 [max_positions, head_dim]: cos in the first half, sin in the second, times the attention factor."""
    inv_freq, attention_factor = rope_inv_freq(params, head_dim, max_position_embeddings)
    head = min(max_positions, max_position_embeddings) if params["rope_type"] == "dynamic" else max_positions
    angles = torch.arange(head, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
    if head < max_positions:
        angles = torch.cat([angles, _dynamic_tail(params, head_dim, head, max_positions)])
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] by cos/sin [T, D/2] (rotate_half on the two halves).

    On CUDA the Triton kernel (`deepinfer_kernels.ops.rotary`) runs instead, with the same roundings."""
    if use_triton(x):
        return ops.rotary(x, cos, sin)
    cos = cos.to(x.dtype)[:, None, :]  # [T, 1, D/2]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the precomputed cos/sin table; `forward` looks up the rows of a step's positions.

    The model calls it once per step and hands (cos, sin) to every layer's `apply_rotary`.
    """

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int):
        super().__init__()
        _check_type(params["rope_type"])
        self.head_dim = head_dim
        self.max_positions = rope_max_positions(params, max_position_embeddings)
        table = rope_cos_sin_table(params, head_dim, max_position_embeddings, self.max_positions)
        self.register_buffer("cos_sin", table, persistent=False)  # [P, D] fp32

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D/2] fp32."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        return cos, sin


def get_rope(hf_config: dict[str, Any], head_dim: int) -> RotaryEmbedding:
    """The rotary embedding a decoder config asks for."""
    return RotaryEmbedding(head_dim, rope_parameters(hf_config), hf_config["max_position_embeddings"])
