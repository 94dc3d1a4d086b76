"""Moving stale stored KV toward its fresh value by its segment's mean deviation.

A passage stored alone missed the same preceding context for every one of its tokens, so much of
its KV's error at a layer is common to the whole passage. The tokens a layer recomputes measure it
anyway (fresh minus stored); their mean per segment, times the policy's share, is added to the
stored KV of every token of that segment, which only the stale ones keep (the recomputed ones are
overwritten by their fresh KV). The recomputed tokens are those that deviate most, so their mean
overstates the common part: a share of 0.5 did best, for K and V alike (K may have a share of its
own, ``stale_shift_k``; none beat 0.5: results/fusion-quality/stale-shift-k-share.md). On the
default model at 15% recompute it took MuSiQue's gap_closed from 0.53 to 0.71
(``scripts/selection_study.py``, 6 cases), for the price of a mean and an add per layer, no recompute.

The means (one small kernel over the active rows) and the shifted stored KV's rotation and write (one
pass over the stored rows) are ``ops.segment_shift`` and ``ops.write_stored_kv``. The inputs are
index tensors of fixed size (stored row and segment per active row, segment per
stored row; rows with no stored KV count toward a spare last segment whose shift is zero), so the
same code runs eagerly and inside the fused prefill's CUDA graphs.

Adding one vector to all of a passage's K (before RoPE) moves the question's log attention mass on
that passage, to first order by ``scale * u . delta``, where ``u`` is the question's query
rotated back through RoPE and averaged with its softmax weights over the passage's tokens. On a few
passages that move overshoots the truth by several nats (MuSiQue case 54, a passage at layer 18:
-4.6 where the fresh KV moves -1.3), and the question then reads the wrong passage. ``begin_k_mass_cap``
caps the move: per passage and KV head, where ``|scale * mean(u) . delta|`` exceeds the policy's
``k_mass_cap``, just enough of ``delta`` along ``mean(u)`` is removed to bring it to the cap, and the
rest of the shift is kept (results/fusion-quality/k-shift-mass-cap.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..layers import RotaryEmbedding

QUESTION_WINDOW = 64  # the question's last tokens whose queries measure the K shift's mass move


@dataclass
class MassCap:
    """What ``begin_k_mass_cap`` reads besides the shift: ``limit`` [1] the cap in nats (a tensor, so a
    captured graph reads the policy's value at replay), ``rows`` [W] the active rows of the question's
    last tokens, ``ok`` [W] which of them are real (a graph pads them to ``QUESTION_WINDOW``),
    ``bounds`` [segments + 1] the stored rows of each segment (``bounds[s]:bounds[s + 1]``). The bounds
    come from the host once a pass, and a graphed pass's rows too, one row set per layer
    (``question_rows``): found again on the device in every capped layer they were ~12 small
    launches a layer. The eager pass makes its rows when a check narrows the active set."""

    limit: torch.Tensor
    rows: torch.Tensor
    ok: torch.Tensor
    bounds: torch.Tensor


def segment_bounds(stored_segment: np.ndarray, segments: int) -> np.ndarray:
    """``MassCap.bounds`` of the stored rows' segments ``stored_segment`` (ascending: each segment is
    one run of rows), for ``segments`` segments."""
    return np.searchsorted(stored_segment, np.arange(segments + 1)).astype(np.int64)


def question_rows(active: np.ndarray, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """``MassCap.rows`` [len(active), QUESTION_WINDOW] and ``ok`` [QUESTION_WINDOW] for active sets of
    ``active`` rows each: the question is the last ``tail`` active rows, of which the last
    ``QUESTION_WINDOW`` count; padding repeats the last row and counts for nothing."""
    width = min(tail, QUESTION_WINDOW)
    ar = np.arange(QUESTION_WINDOW)
    last = np.maximum(active - 1, 0)[:, None]
    return np.minimum(np.maximum(last + 1 - width + ar, 0), last), ar < width


@dataclass
class ShiftIndex:
    """Where each active row's stored KV is, and which segment every row belongs to.

    ``active_rows`` [active]: row of the loaded stored KV per active token (any valid row where it
    has none); ``active_segment`` [active]: its stored segment, or ``num_segments - 1`` (the spare)
    where it has no stored KV; ``stored_segment`` [stored]: the stored segment of each stored row.
    ``share``: (K share, V share) [2] as a tensor, so a captured graph reads the policy's values at replay."""

    share: torch.Tensor
    active_rows: torch.Tensor
    active_segment: torch.Tensor
    stored_segment: torch.Tensor
    num_segments: int
    cap: MassCap | None = None  # cap the K shift's move of the question's attention mass (None: no cap)


def segment_shift(
    index: ShiftIndex, k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor, v_st: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shift of every stored row, as ``ops.write_stored_kv`` applies it: (K shift, V shift) per
    segment [segments, KVH, D] float32, measured on the active rows' fresh ``k_new``/``v_new``
    [active, KVH, D] against their stored ``k_st``/``v_st`` rows, and each stored row's segment."""
    mk, mv = ops.segment_shift(k_new, v_new, k_st, v_st, index.active_rows, index.active_segment, index.share,
                               index.num_segments)
    return mk, mv, index.stored_segment


def begin_k_mass_cap(
    index: ShiftIndex, q: torch.Tensor, k_st: torch.Tensor, at: torch.Tensor, rotary: RotaryEmbedding, scale: float,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Start capping the K shift: returns the function that takes the shift ``mk`` [segments, KVH, D]
    and gives it back with each segment's first-order move of the question's log attention mass capped
    at ``index.cap.limit`` nats per KV head. What needs no shift (the question's mass direction over
    the stored K) starts now, beside the shift's own means on CUDA (``ops.begin_k_mass_cap``).

    ``q`` [active, H, D]: the active rows' queries, rotated; ``k_st`` [stored, KVH, D] the stored K
    before RoPE and ``at`` its model positions (``ub`` is the mean over the question's tokens and the KV
    head's query heads of the direction in which adding delta to a segment's K moves the query's log
    attention mass on it, the move ``m = scale * ub . delta``; where ``|m| > limit``,
    ``(|m| - limit) * sign(m) / (scale * |ub|^2) * ub`` comes off delta). Fixed shapes and no host
    reads: it runs inside the fused prefill's CUDA graphs."""
    cap = index.cap
    assert cap is not None
    return ops.begin_k_mass_cap(q.index_select(0, cap.rows), cap.ok, k_st, at, rotary.cos, rotary.sin, cap.bounds,
                                cap.limit, scale)
