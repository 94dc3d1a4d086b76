"""One decoder layer of the fused prefill, in the two halves a check layer goes between.

``front`` writes the stored tokens' KV (K rotated to its real positions) and the active tokens'
fresh KV into the layer's cache pages; ``back`` runs the active tokens' attention over the whole
fused prompt and the rest of the layer. A check layer narrows the active set in between, using the
fresh and stored KV; every other layer runs both halves back to back. Eagerly or inside a CUDA graph
(``graphs.FusionGraphs``, which captures whole check layers too), it is the same code.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..attention import RelayMetadata
from ..layers import RotaryEmbedding
from .stale_shift import ShiftIndex, begin_k_mass_cap, segment_shift

KVCache = tuple[torch.Tensor, torch.Tensor]


def front(
    layer: nn.Module,
    kv_cache: KVCache,
    rotary: RotaryEmbedding,
    stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    slots: torch.Tensor,
    shift: ShiftIndex | None = None,
    keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """KV of the layer in its pages; returns the active tokens' (q rotated, k before RoPE, v, residual)
    and, with ``keep`` (a check layer compares and reverts them), the stored (K before RoPE, V) as
    written (``None`` without stored KV or without ``keep``).

    ``stored`` = (K before RoPE, V, model positions, cache slots) of the stored tokens: written
    first, so the active tokens' fresh KV, written after, overwrites theirs. With ``shift`` the
    stored KV is first moved by its segment's mean deviation on the active tokens (``stale_shift``),
    its K part capped by the question's queries where ``shift.cap`` is set."""
    attn = layer.self_attn.attn
    if residual is None:
        residual, h = hidden, layer.input_layernorm(hidden)
    else:  # the sum over the residual itself: a graph's static residual stays where the next layer reads it
        h, residual = layer.input_layernorm(hidden, residual, in_place=True)
    q, k_raw, v = layer.self_attn.project(h)
    q, k = ops.apply_rope_qk(q, k_raw, positions, rotary.cos, rotary.sin)
    written = None
    if stored is not None:
        k_st, v_st, at, st_slots = stored
        moved = None
        if shift is not None:
            # the question's queries bound how far the K shift moves its attention: what of that needs
            # no shift runs beside the shift's means
            capper = begin_k_mass_cap(shift, q, k_st, at, rotary, attn.scale) if shift.cap is not None else None
            mk, mv, segment = segment_shift(shift, k_raw, v, k_st, v_st)
            moved = (capper(mk) if capper is not None else mk, mv, segment)
        written = ops.write_stored_kv(k_st, v_st, at, rotary.cos, rotary.sin, kv_cache, st_slots, moved, keep)
    attn.store(k, v, kv_cache, slots)
    return q, k_raw, v, residual, written


def first_layer_kv(block: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's (K before RoPE, V) of the tokens ``ids``, from their embeddings alone. A token's
    first-layer KV depends on nothing but the token (no attention comes before it), so stored KV
    of layer 0 equals this wherever the segment was computed: a pass can make it instead of
    waiting for its read, the one read no compute precedes."""
    layer = block.layers[0]
    _, k_raw, v = layer.self_attn.project(layer.input_layernorm(block.embed_tokens(ids)))
    return k_raw, v


def revert(
    kv_cache: KVCache,
    rotary: RotaryEmbedding,
    written: tuple[torch.Tensor, torch.Tensor],
    stored: tuple[torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """After a check layer's selection: the stored KV back in the pages (``written`` = the stored
    (K before RoPE, V) as ``front`` wrote them, at ``stored`` = (model positions, slots)), then the
    kept tokens' fresh KV over it (``kept`` = K before RoPE, V, positions, slots), so the tokens the
    check dropped read as stored KV from this layer on."""
    ops.write_stored_kv(*written, stored[0], rotary.cos, rotary.sin, kv_cache, stored[1], keep=False)
    k_raw, v, positions, slots = kept
    ops.write_stored_kv(k_raw, v, positions, rotary.cos, rotary.sin, kv_cache, slots, keep=False)


def back(
    layer: nn.Module,
    kv_cache: KVCache,
    q: torch.Tensor,
    residual: torch.Tensor,
    q_positions: torch.Tensor | None,
    table: torch.Tensor,
    seq_len: int,
    seq_slots: torch.Tensor | slice,
    bounds: torch.Tensor,
    relay: RelayMetadata | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The active tokens' attention over the fused prompt, then the MLP: (hidden, residual). The new
    residual is written over ``residual`` and the hidden state into ``out`` where given: a graph's
    static buffers, which the next layer's replay reads (a copy into each was ~3 us a layer)."""
    o, _ = layer.self_attn.attn.attend(q, q_positions, kv_cache, table, seq_len, seq_slots, bounds, relay)
    h = layer.self_attn.o_proj(o.reshape(q.shape[0], -1))
    h, residual = layer.post_attention_layernorm(h, residual, in_place=True)
    return layer.mlp(h, out), residual
