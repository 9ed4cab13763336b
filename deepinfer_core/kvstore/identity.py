"""Which KV a stored block holds: the namespace every key of one engine's blocks carries.

The KV layout fingerprint (`transfer.layout.KVLayout`) says what a block's bytes mean: architecture,
model config, dtype, block size, shapes. That is enough between a PE and a CE started together, not
for a store that outlives them: two checkpoints with one config (a base model and its fine-tune)
have one layout and different KV. So the namespace adds the weights' identity and the operator's
`KVStoreConfig.namespace` (anything else that changes KV).

Hashing every weight byte would read a whole checkpoint at start-up; instead each weight file
contributes its name, its size and a few samples spread over it (its safetensors header among
them), which tells apart any two checkpoints that were not made byte-identical in those places.
Seeded weights (the built-in model, `load_format="dummy"`) are identified by their seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from deepinfer_core.config import ModelConfig
from deepinfer_core.transfer.layout import KVLayout

_SAMPLES = 8
_SAMPLE_BYTES = 64 * 1024
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def store_namespace(layout: KVLayout, model: ModelConfig, extra: str = "") -> bytes:
    """16 bytes naming the KV of this model, its weights and its layout (plus `extra`)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kv-store-namespace-v1\0")
    h.update(layout.fingerprint.encode())
    h.update(weights_identity(model).encode())
    h.update(json.dumps(model.hf_config.get("quantization_config"), sort_keys=True).encode())
    h.update(extra.encode())
    return h.digest()


def weights_identity(model: ModelConfig) -> str:
    if model.builtin or model.load_format == "dummy":
        return f"seeded:{model.seed}"
    files = sorted(f for pattern in _WEIGHT_PATTERNS for f in glob.glob(os.path.join(model.path, pattern)))
    if not files:
        return f"path:{os.path.realpath(model.path)}"
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(0, size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return "weights:" + h.hexdigest()
