"""Taking a finished turn's KV out of the paged cache, without stalling the engine.

The cache holds K rotated to its positions; sessions store K without position (AttentionStore's
decoupled positional encoding), so the snapshot rotates K back by its own positions on the device,
then copies to page-locked host memory on a side stream. The compute stream only pays for the
gather and the un-rotation (a few element-wise kernels); the copy runs beside the next decode steps,
and a background thread waits on its event. On a CPU device the same steps run without streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import RotaryEmbedding
from ..ops import apply_rope


@dataclass
class Snapshot:
    """A turn's KV on its way to host memory: ``layers`` [layers, 2, tokens, kv_heads, head_dim]
    (K without position, V) is complete once ``ready`` has fired (None: already complete)."""

    layers: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.layers


def unrotate(k: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """K [tokens, heads, dim] rotated to ``positions`` -> K without position (rotation by -angle)."""
    return apply_rope(k, positions, rotary.cos, -rotary.sin)


def take_snapshot(
    k: torch.Tensor, v: torch.Tensor, rotary: RotaryEmbedding, stream: torch.cuda.Stream | None = None,
) -> Snapshot:
    """Start copying a sequence's gathered KV (``k``, ``v``: [layers, tokens, kv_heads, dim], new
    tensors, K rotated to positions 0, 1, ...) to host memory; returns at once on CUDA (``stream``
    does the copy), after the copy elsewhere. The caller gathers: from the paged cache
    (``KVCache.gather``), or from the swap space's host copy of a preempted turn."""
    layers, n, heads, dim = k.shape
    positions = torch.arange(n, device=k.device)
    flat = k.permute(1, 0, 2, 3).reshape(n, layers * heads, dim)  # every layer's heads at once
    k = unrotate(flat, positions, rotary).reshape(n, layers, heads, dim).permute(1, 0, 2, 3)
    kv = torch.stack((k, v), dim=1)  # [layers, 2, tokens, heads, dim]
    if kv.device.type != "cuda":
        return Snapshot(kv.contiguous(), None)
    assert stream is not None, "a CUDA snapshot needs a side stream"
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        host.copy_(kv, non_blocking=True)
        kv.record_stream(stream)  # the allocator must not reuse kv's memory before the copy ends
        event = torch.cuda.Event()
        event.record(stream)
    return Snapshot(host, event)
