"""Builds a model on its device in the configured dtype and fills its weights.

Weights come from the checkpoint's safetensors files (one `model.safetensors`, or the shards a
`model.safetensors.index.json` lists), read with `safe_open` one tensor at a time from
memory-mapped files and copied straight into the parameters, so peak host memory stays near the
model size rather than twice it. The built-in tiny model has no weight files: its weights are
drawn from a seeded CPU generator, the same on every machine and every call. `load_format="dummy"`
reads no weight file either: it draws random weights on the model's device from a seeded generator
(vLLM's option of that name), so a benchmark can run a 60 GB model's shapes without writing it out;
the values repeat for a seed on one kind of device, not across kinds.

Every failure names its cause: a missing directory or weight file, a corrupt or truncated file,
tensors the model needs but the checkpoint lacks, tensors the model does not use.

Optional model attributes the loader honours:
    `expected_weight_names()`: checkpoint names that must be loaded, for models whose parameter
        names differ from checkpoint names (default: the parameter names);
    `max_positions`: longest context the position encoding supports;
    `sliding_window`: an active attention window, which this engine does not implement;
    `holds_weight(name)` (vision encoders): whether a checkpoint tensor is theirs, so
        `load_vision_encoder` reads only the vision tower and projector of a multimodal checkpoint.

Quantized checkpoints: block-scaled FP8 (DeepSeek-V3's release) loads (`quantization`); the
model's `keeps_fp8(name)` says which FP8 weights it stores as they are, the rest are dequantized
on the way in. Other quantizations are refused.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.moe import FusedExperts, building_local_experts
from deepinfer_core.models.quantization import dequantize_fp8_stream, fp8_block_size
from deepinfer_core.models.registry import get_model_class, get_vision_encoder_class
from deepinfer_kernels.fp8 import FP8_DTYPE

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# checkpoint tensors that are derived buffers, never parameters
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PROGRESS_MIN_TENSORS = 64
_MAX_LISTED = 10


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    shard: Callable[[nn.Module], None] | None = None,
    expert_slots: list[int] | None = None,
) -> nn.Module:
    """The model of `model_config` on `device`, weights loaded, in eval mode.

    `shard(model)` (expert parallelism) runs before checkpoint weights load and after seeded
    weights are drawn, so a rank's slice of a seeded model equals the whole model's.
    `expert_slots` (an expert-parallel rank's logical expert per local slot): from a checkpoint,
    only those experts are built and only their tensors read, and dummy weights are drawn for those
    experts alone (per expert), so the rank's memory at load is its shard. The built-in model's
    seeded weights are drawn whole, then sharded: every rank draws the numbers of one process
    holding every expert.

    Raises:
        FileNotFoundError: the directory, its weights or an indexed shard is missing.
        ValueError: unsupported architecture, corrupt weight file, missing or unexpected tensors,
            or a `max_model_len` the model cannot serve.
    """
    hf_config = normalize_hf_config(model_config.hf_config)
    fp8_block = fp8_block_size(hf_config)  # raises for quantizations that do not load
    model_cls = get_model_class(hf_config)
    dummy = model_config.load_format == "dummy"
    shards = None if model_config.builtin or dummy else read_tensor_names(weight_files(model_config.path))
    slots = expert_slots if shards is not None or dummy else None
    with torch.device(device), building_local_experts(slots):
        model = model_cls(hf_config, model_config.dtype)
    check_context_limits(model, model_config)
    std = hf_config.get("initializer_range", 0.02)
    if dummy:
        init_dummy_weights(model, model_config.seed, std)
    elif shards is None:
        init_builtin_weights(model, model_config.seed, std)
    if shard is not None:
        shard(model)
    if shards is not None:
        load_checkpoint(model, shards, fp8_block)
    return model.eval()


def load_vision_encoder(model_config: ModelConfig, device: str | torch.device) -> nn.Module:
    """The vision encoder alone (tower + projector, `encode_images`) of a multimodal checkpoint,
    for a vision-encoder process; the language model's tensors are skipped unread.

    Raises:
        ValueError: the architecture has no vision encoder, or the checkpoint's vision tensors are
            incomplete.
    """
    hf_config = normalize_hf_config(model_config.hf_config)
    encoder_cls = get_vision_encoder_class(hf_config)
    if model_config.builtin:  # the encoder's weights are drawn with the whole model's, in its order
        return load_model(model_config, device).eval()
    if model_config.load_format == "dummy":
        with torch.device(device):
            encoder = encoder_cls(hf_config, model_config.dtype)
        init_dummy_weights(encoder, model_config.seed, hf_config.get("initializer_range", 0.02))
        return encoder.eval()
    shards = read_tensor_names(weight_files(model_config.path))
    with torch.device(device):
        encoder = encoder_cls(hf_config, model_config.dtype)
    held = {f: [n for n in names if encoder.holds_weight(n)] for f, names in shards.items()}
    load_checkpoint(encoder, {f: names for f, names in held.items() if names}, fp8_block_size(hf_config))
    return encoder.eval()


def weight_files(path: str) -> list[str]:
    """The safetensors files holding a checkpoint's weights."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        return _files_from_index(index)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors) in {path!r}")
    return found


def _files_from_index(index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
    files = [os.path.join(os.path.dirname(index), n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
    return files


def read_tensor_names(files: list[str]) -> dict[str, list[str]]:
    """file -> tensor names, read from each header; a corrupt or truncated file raises ValueError."""
    shards = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                shards[file] = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read safetensors file {file} (corrupt or truncated?): {e}") from None
    return shards


def iter_tensors(shards: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) one at a time from memory-mapped files, with a progress bar on a tty."""
    total = sum(len(names) for names in shards.values())
    quiet = total < _PROGRESS_MIN_TENSORS or not sys.stderr.isatty()
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=quiet) as bar:
        for file, names in shards.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except SafetensorError as e:
                        raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from None
                    yield name, tensor
                    bar.update()


def load_checkpoint(model: nn.Module, shards: dict[str, list[str]], fp8_block: tuple[int, int] | None = None) -> None:
    """Stream every tensor into `model.load_weights`, then insist nothing is missing or left over.
    From a block-FP8 checkpoint (`fp8_block`), weights the model does not keep in FP8 arrive
    dequantized."""
    seen: list[str] = []
    absorbed: set[str] = set()  # FP8 factors used up by dequantizing their weight
    skipped: set[str] = set()  # tensors the model does not read (another expert-parallel rank's experts)
    weight_filter = getattr(model, "weight_filter", None)
    if weight_filter is not None:
        reads = weight_filter()
        skipped = {n for names in shards.values() for n in names if not reads(n)}
        shards = {f: [n for n in names if n not in skipped] for f, names in shards.items()}

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_tensors(shards):
            seen.append(name)
            yield name, tensor

    stream = tracked()
    if fp8_block is not None:
        keeps_fp8 = getattr(model, "keeps_fp8", lambda name: False)
        stream = dequantize_fp8_stream(stream, fp8_block, keeps_fp8, absorbed)
    consumed = model.load_weights(stream)
    check_loaded(model, seen + sorted(skipped), consumed | absorbed | skipped)


def _expected_names(model: nn.Module) -> set[str]:
    expected = getattr(model, "expected_weight_names", None)
    return set(expected()) if expected else {name for name, _ in model.named_parameters()}


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def check_loaded(model: nn.Module, seen: list[str], consumed: set[str]) -> None:
    """ValueError listing tensors the model needs but did not get, or got but does not use."""
    missing = sorted(_expected_names(model) - consumed)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {_listing(missing)}")
    unexpected = sorted(n for n in set(seen) - consumed if not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) the model does not use: {_listing(unexpected)}")


def _init_weights(model: nn.Module, fill_matrix, std: float, skip: frozenset[str] = frozenset()) -> None:
    """Zero biases, ones for norms (1-D weights), `fill_matrix(param)` for matrices and embeddings.
    FP8 weights (block factors `*_scale_inv`) get the same distribution: values drawn in fp32 and
    divided by `std`, factors of `std`. Parameters named in `skip` are left alone."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in skip:
                continue
            if name.endswith("bias"):
                param.zero_()
            elif name.endswith("_scale_inv"):
                param.fill_(std)
            elif param.dim() == 1:
                param.fill_(1.0)
            elif param.dtype == FP8_DTYPE:
                drawn = torch.empty(param.shape, device=param.device)
                fill_matrix(drawn)
                param.copy_((drawn / std).to(FP8_DTYPE))
            else:
                fill_matrix(param)


def init_builtin_weights(model: nn.Module, seed: int, std: float) -> None:
    """Deterministic weights: normal(0, std) matrices and embeddings, ones for norms, zero biases.

    Drawn in fp32 from a CPU generator in parameter order, then cast and copied to the
    parameter's device, so every machine and every call gets the same values for a seed.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    _init_weights(model, lambda p: p.copy_(torch.empty(p.shape, device="cpu").normal_(0.0, std, generator=gen)), std)


def init_dummy_weights(model: nn.Module, seed: int, std: float) -> None:
    """Random weights for `load_format="dummy"`: as `init_builtin_weights`, but drawn in place on
    each parameter's device (a CUDA model's 30B parameters take a second, not the minutes a CPU
    generator would). Repeatable for a seed on one device kind.

    Each routed expert is drawn from a generator of its own (seeded by the seed, its tensor's name
    and its logical id), the rest in parameter order: an expert-parallel rank that built only its
    experts draws exactly the numbers one process holding every expert has for them.
    """
    generators: dict[torch.device, torch.Generator] = {}

    def fill(param: torch.Tensor) -> None:
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generators[param.device])

    experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedExperts)}
    stacked = {f"{prefix}.{p}": (m, t) for prefix, m in experts.items() for p, t in m.named_parameters(recurse=False)}
    _init_weights(model, fill, std, frozenset(stacked))
    with torch.no_grad():
        for name, (module, param) in stacked.items():
            for slot, expert in enumerate(module.local_experts):
                _fill_expert(param[slot], name, expert, seed, std)


def _fill_expert(target: torch.Tensor, name: str, expert: int, seed: int, std: float) -> None:
    """One expert's slice of a stacked expert tensor, by `_init_weights`' rules, from its own generator."""
    if name.endswith("_scale_inv"):
        target.fill_(std)
        return
    gen = torch.Generator(device=target.device).manual_seed(seed ^ zlib.crc32(f"{name}:{expert}".encode()))
    if target.dtype == FP8_DTYPE:
        drawn = torch.empty(target.shape, device=target.device).normal_(0.0, std, generator=gen)
        target.copy_((drawn / std).to(FP8_DTYPE))
    else:
        target.normal_(0.0, std, generator=gen)


def check_context_limits(model: nn.Module, model_config: ModelConfig) -> None:
    """ValueError when `max_model_len` is beyond what the model's attention can serve."""
    max_len = model_config.max_model_len
    limit = getattr(model, "max_positions", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"max_model_len={max_len} exceeds the {limit} positions the model's RoPE supports")
    window = getattr(model, "sliding_window", None)
    if window is not None and window < max_len:
        raise ValueError(
            f"{model_config.architecture} config enables sliding-window attention (window {window}) "
            f"shorter than max_model_len={max_len}; sliding windows are not supported, "
            f"set max_model_len <= {window}"
        )
