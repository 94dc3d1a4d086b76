"""Stored KV into a layer's cache pages, as cache fusion writes it at every layer (torch reference).

A fused prefill writes the stored tokens' KV (K kept before RoPE) into the pages at each layer:
K rotated to the token's real position, and, with the stale shift, K and V first moved by their
segment's share of mean deviation, measured on the tokens the layer recomputes
(``engine/fusion/stale_shift.py`` says why). Done as separate torch ops that is ~10 launches and
three passes over all stored rows a layer (~70 us of a 0.55 ms layer on an H100 for 3072 stored
tokens of a 7B model); ``stored_kv_triton`` does it in two launches: the per-segment means over the
few active rows, then one pass over the stored rows that shifts, rotates and writes.
"""

from __future__ import annotations

import torch

from .rope import apply_rope_ref


def segment_shift_ref(
    k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor, v_st: torch.Tensor, active_rows: torch.Tensor,
    active_segment: torch.Tensor, share: torch.Tensor, num_segments: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment, ``share`` = (K share, V share) [2] x the mean of (fresh - stored) over its active
    rows: float32 [num_segments, KVH, D] for K (before RoPE) and V. ``k_new``/``v_new`` [active, KVH,
    D] are the active rows' fresh K/V, ``active_rows`` their rows of the stored ``k_st``/``v_st`` and
    ``active_segment`` their segments; the last segment is the spare (rows without stored KV, padding)
    and shifts nothing, as does a segment without active rows."""
    dk = k_new.float() - k_st.index_select(0, active_rows).float()
    dv = v_new.float() - v_st.index_select(0, active_rows).float()
    s = num_segments
    count = torch.zeros(s, device=dk.device).index_add_(0, active_segment, torch.ones_like(active_segment,
                                                                                         dtype=torch.float))
    scale = (1.0 / count.clamp(min=1.0)).masked_fill(torch.arange(s, device=dk.device) == s - 1, 0.0)[:, None, None]
    mk = torch.zeros(s, *dk.shape[1:], device=dk.device).index_add_(0, active_segment, dk) * (scale * share[0])
    mv = torch.zeros(s, *dv.shape[1:], device=dv.device).index_add_(0, active_segment, dv) * (scale * share[1])
    return mk, mv


def write_stored_kv_ref(
    k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    shift: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Write K (before RoPE, [T, KVH, D]) rotated to ``positions`` and V at ``slots`` of the paged
    cache; a negative slot writes nothing (a captured graph's padding). With ``shift`` = (mk, mv,
    segment per row) from ``segment_shift_ref``, K and V first move by their row's segment shift,
    rounded to their dtype. Returns the K (before RoPE) and V as written (the shifted ones, or the
    inputs themselves without a shift) when ``keep``: a layer that never reads them back (no check
    there) saves the Triton kernel writing them out."""
    if shift is not None:
        mk, mv, segment = shift
        k = (k.float() + mk.index_select(0, segment)).to(k.dtype)
        v = (v.float() + mv.index_select(0, segment)).to(v.dtype)
    live = slots >= 0
    kw, vw, at, pos = k, v, slots, positions
    if not bool(live.all()):  # padding rows (graphs only): masked out; the CPU pass has none and copies nothing
        kw, vw, at, pos = k[live], v[live], slots[live], positions[live]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, at, apply_rope_ref(kw, pos, cos, sin).to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, at, vw.to(v_cache.dtype))
    return (k, v) if keep else None
