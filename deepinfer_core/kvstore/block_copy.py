"""Copies between the paged KV cache and host pool slots.

A block of the cache is `num_layers` regions (one per layer, `[num_layers, num_blocks, *block]`);
its slot payload is those regions back to back, layer by layer. On a GPU, a save's copy into
pinned slots runs on the store's own stream, after every step queued so far (which wrote those
blocks), beside the steps that follow: the engine does not wait, the returned event tells the I/O
thread when the bytes are there, and the blocks stay held (not reusable) until it has fired. A
load's copy is queued on the current stream; the caller waits for it before the slots may be
reused.
"""

from __future__ import annotations

from typing import Optional

import torch

from deepinfer_core.kvstore.host_pool import HostPool


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)


def _slot_view(pool: HostPool, slot: int, kv: torch.Tensor) -> torch.Tensor:
    """Slot `slot`'s payload as one block of `kv`: `[num_layers, *block]`."""
    return pool.payload_rows[slot].view(kv.dtype).view(kv.shape[0], *kv.shape[2:])


def blocks_to_slots(
    kv: torch.Tensor, blocks: list[int], pool: HostPool, slots: list[int], stream: Optional[torch.cuda.Stream] = None
) -> Optional[torch.cuda.Event]:
    """Copy KV blocks into slot payloads. On a GPU the copy is queued on `stream` (default: the
    current one) behind everything queued so far on the current stream, and the returned event marks
    it done: on a side stream the blocks must not be reused before it (the caller holds them)."""
    if not kv.is_cuda:  # one strided copy per block, straight into its slot
        for block, slot in zip(blocks, slots):
            _slot_view(pool, slot, kv).copy_(kv[:, block])
        return None
    written = torch.cuda.Event()
    written.record()  # every step that wrote these blocks is queued before this point
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        stream.wait_event(written)
        gathered = kv.index_select(1, _index(blocks, kv.device)).transpose(0, 1).contiguous()  # [n, L, *block]
        for i, slot in enumerate(slots):
            _slot_view(pool, slot, kv).copy_(gathered[i], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def slots_to_blocks(pool: HostPool, slots: list[int], kv: torch.Tensor, blocks: list[int]) -> None:
    """Copy slot payloads into KV blocks; returns once the slots may be reused."""
    if not kv.is_cuda:
        for slot, block in zip(slots, blocks):
            kv[:, block].copy_(_slot_view(pool, slot, kv))
        return
    staged = torch.empty((len(slots), kv.shape[0], *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
    for i, slot in enumerate(slots):
        staged[i].copy_(_slot_view(pool, slot, kv), non_blocking=True)
    kv.index_copy_(1, _index(blocks, kv.device), staged.transpose(0, 1))
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
