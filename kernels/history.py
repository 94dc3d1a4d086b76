"""A stored history's KV written into a sequence's cache pages, K rotated to its new positions.

A session stores K without position (so a cut history can be re-placed); a turn writes each layer
of it into the pages of the new sequence, token ``t`` (stored row ``rows[t]``, or row ``t``) at
position ``t``. This is the plain-torch reference of ``history_triton``, which does the rotation
and both writes in one pass.
"""

from __future__ import annotations

import torch

from .paged_attention import sequence_slots
from .rope import apply_rope_ref


def write_history_ref(
    kv: torch.Tensor, num_tokens: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor | None = None,
) -> None:
    """Write ``num_tokens`` tokens of one layer's stored ``kv`` [2, stored rows, kv_heads, head_dim]
    (K without position, V) into the pages of ``block_table`` [blocks] int32: token ``t`` is row
    ``rows[t]`` (None: row ``t``), its K rotated to position ``t``."""
    k, v = kv[0], kv[1]
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    k, v = k[:num_tokens], v[:num_tokens]
    positions = torch.arange(num_tokens, device=kv.device)
    slots = sequence_slots(block_table, num_tokens, k_cache.shape[1])
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    kf.index_copy_(0, slots, apply_rope_ref(k.float(), positions, cos, sin).to(k_cache.dtype))
    vf.index_copy_(0, slots, v.to(v_cache.dtype))
