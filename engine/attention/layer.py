"""``Attention``: the single place where a layer's queries meet the paged KV cache.

It writes the step's new K/V into the cache, then runs the backend chosen for the device. Backends
return the output and its log-sum-exp so later paths (relay system prompts, split KV, fusion) can
merge partial attentions exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ragfuse.kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref

from .metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' K/V [tokens, kv_heads, head_dim] at their cache slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k/v [T, KVH, D] for the step's new tokens -> (out [T, H, D], lse [T, H])."""
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        slots = meta.sequence_slots() if q.device.type == "cpu" else None
        if meta.is_prefill:
            return paged_prefill_attention_ref(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                self.scale, self.sliding_window, slots,
            )
        return paged_decode_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, self.sliding_window, slots
        )
