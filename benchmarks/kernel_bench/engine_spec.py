"""What an engine bench run measures: the model presets, the run's sizes (`Spec`) and the
command-line flags that choose them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

ZOS_ENV = "DEEPINFER_ZERO_OVERHEAD_SCHEDULING"
WARMUP_STEPS = 3  # decode steps left out of the median
MIN_DECODE_STEPS = 4  # measured decode steps, at least (the run goes past new_tokens if it must)
PREFILL_REPS = 3
PROFILER_WARMUP = 2
STD = 0.02
SEED = 0

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_act="silu",
    attention_bias=False,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    initializer_range=STD,
)
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B's config.json, the architecture fields
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=151936,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # the same architecture at toy sizes (2 * moe_intermediate != hidden: a transposed expert layout shows)
    "tiny": dict(
        _QWEN3_MOE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}
# per preset: batch, context, prefill tokens, new tokens, profiled steps when not given
RUN_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3-30b-a3b": dict(batch=64, context=4096, prefill_tokens=8192, new_tokens=32, profile_steps=20),
    "tiny": dict(batch=4, context=64, prefill_tokens=128, new_tokens=8, profile_steps=8),
}


@dataclass
class Spec:
    preset: str
    layers: int
    batch: int
    context: int
    prefill_tokens: int
    new_tokens: int
    profile_steps: int
    zos: tuple[bool, ...]
    hf: bool
    device: str

    @property
    def hf_config(self) -> dict[str, Any]:
        return dict(PRESETS[self.preset], num_hidden_layers=self.layers)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_max_tokens(self) -> int:
        """Output tokens each decode request may make: new_tokens, enough measured steps, the
        profiled steps and the routing-count step, with a little slack."""
        measured = max(self.new_tokens, 1 + WARMUP_STEPS + MIN_DECODE_STEPS)
        profiled = self.profile_steps + PROFILER_WARMUP if self.cuda else 0
        gaps = self.gap_steps + 1 if self.cuda else 0
        return measured + profiled + gaps + 4

    @property
    def gap_steps(self) -> int:
        """Decode steps timed with CUDA events (`measure_gaps`)."""
        return max(self.profile_steps, 5)

    @property
    def max_model_len(self) -> int:
        return max(self.context + self.decode_max_tokens, self.prefill_tokens + 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine (whole engine steps; default sizes depend on the preset)")
    g.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    g.add_argument("--layers", type=int, help="decoder layers (default: the preset's; the table says how many)")
    g.add_argument("--batch", type=int, help="decode batch (qwen3-30b-a3b: 64, tiny: 4)")
    g.add_argument("--context", type=int, help="prompt tokens per decode sequence (4096 / 64)")
    g.add_argument("--prefill-tokens", type=int, help="tokens of the timed prefill (8192 / 128)")
    g.add_argument("--new-tokens", type=int, help="tokens generated per sequence (32 / 8)")
    g.add_argument("--profile-steps", type=int, help="decode steps under the profiler, CUDA only (20 / 8)")
    g.add_argument("--zos", choices=("both", "on", "off"), default="both", help="zero-overhead scheduling settings")
    g.add_argument("--no-hf", action="store_true", help="skip transformers generate")


def spec_from_args(args: argparse.Namespace) -> Spec:
    defaults = RUN_DEFAULTS[args.preset]
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"

    def pick(name: str) -> int:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    zos = {"both": (True, False), "on": (True,), "off": (False,)}[args.zos]
    spec = Spec(args.preset, layers, pick("batch"), pick("context"), pick("prefill_tokens"), pick("new_tokens"),
                pick("profile_steps"), zos, not args.no_hf, device)  # fmt: skip
    if min(spec.layers, spec.batch, spec.context, spec.prefill_tokens, spec.new_tokens) < 1:
        raise ValueError("--layers, --batch, --context, --prefill-tokens and --new-tokens must be >= 1")
    return spec
