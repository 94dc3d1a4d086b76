"""The pieces a fused prompt is made of, and the stored KV some of them bring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class LayerSource(Protocol):
    """Stored KV of one segment, readable one layer at a time so loading can overlap compute.

    K is stored before RoPE (position independent): the fusor rotates it to wherever the segment
    lands in the prompt. ``load_layer`` may block (disk, network); it runs on a loader thread.
    """

    tier: str
    blocking: bool  # whether load_layer waits on I/O (disk, network): then it runs on a reader thread

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K before RoPE, V) of ``layer``, each [tokens, kv_heads, head_dim]."""
        ...


@dataclass
class TensorKV:
    """KV already in memory, e.g. straight from ``LLMEngine.compute_kv``: [layers, tokens, ...]."""

    k: torch.Tensor
    v: torch.Tensor
    tier: str = "memory"
    blocking = False

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


@dataclass
class Segment:
    """A run of prompt tokens; with ``kv`` its KV is stored and may be reused instead of computed."""

    token_ids: list[int]
    kv: LayerSource | None = None
    label: str = ""
