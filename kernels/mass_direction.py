"""Which way a passage's K shift moves the question's attention to it (torch reference).

Cache fusion's stale shift adds one vector ``delta`` to all of a passage's K before RoPE. For a
question query ``q`` (rotated) that moves the log of its attention mass on the passage,
``log sum_t exp(scale * q . R(p_t) k_t)``, by ``scale * u . delta`` to first order, where
``u = sum_t w_t R(p_t)^T q`` and ``w`` is the query's softmax over the passage's tokens alone. Since
``R(p)^T`` is a rotation by ``-p`` per frequency, ``u`` needs only the ``w``-weighted sums of the
tokens' cos and sin: ``u = (q1 C + q2 S, q2 C - q1 S)`` with ``C = sum_t w_t cos(p_t)`` and
``S = sum_t w_t sin(p_t)`` (``q1``, ``q2`` the halves of ``q``). The stale shift's mass cap
(``engine/fusion/stale_shift.py``) reads the mean of ``u`` over the question's tokens and each KV
head's query heads, and caps each segment's move there (``cap_k_shift_ref``).
``mass_direction_triton`` computes both without a score tensor in memory.
"""

from __future__ import annotations

import torch

from .rope import apply_rope_ref


def mass_direction_ref(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    segment: torch.Tensor, num_segments: int, scale: float,
) -> torch.Tensor:
    """Mean ``u`` [num_segments, KVH, D] float32 per stored segment and KV head.

    ``q`` [W, H, D]: the question's queries, rotated; ``ok`` [W] bool: which of them count (the rest
    are padding); ``k`` [T, KVH, D]: the stored K before RoPE, at model positions ``at`` [T];
    ``segment`` [T]: each stored row's segment, in ascending order (the Triton kernel reads each
    segment as one run of rows). The mean is over the real queries and the KV head's query heads; a
    segment without rows gets zeros. Float32 throughout: the scores, a per-segment softmax, the
    weighted queries per stored token, and their rotation back."""
    w_rows, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    group = heads // kv_heads
    qs = q.float() * ok[:, None, None]
    qs = qs.view(w_rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, w_rows * group, dim)
    k_rot = apply_rope_ref(k.float(), at, cos, sin).permute(1, 2, 0)  # [KVH, D, T]
    one_hot = (segment[None] == torch.arange(num_segments, device=q.device)[:, None]).float()  # [S, T]
    # the score tensor [KVH, W * group, T] is the one big operand: made once, then changed in place
    # into the softmax within each segment (each segment's max by scatter, its sum by a product)
    w = torch.bmm(qs * scale, k_rot)
    seg = segment.expand_as(w)
    top = torch.full((*w.shape[:2], num_segments), float("-inf"), device=w.device)
    top = top.scatter_reduce(-1, seg, w, "amax")
    w.sub_(top.gather(-1, seg)).exp_()
    w.div_(torch.matmul(w, one_hot.t()).gather(-1, seg))
    a = torch.bmm(w.transpose(1, 2), qs)  # [KVH, T, D]: softmax-weighted queries per token
    c, s = cos[at].float(), sin[at].float()
    a1, a2 = a[..., :half], a[..., half:]
    u = torch.cat((a1 * c + a2 * s, a2 * c - a1 * s), dim=-1)
    count = (ok.sum() * group).clamp(min=1)
    return torch.einsum("st,gtd->sgd", one_hot, u) / count


def cap_k_shift_ref(
    mk: torch.Tensor, q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, segment: torch.Tensor, limit: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The K shift ``mk`` [segments, KVH, D] float32 with each segment's move ``m = scale * ub . delta``
    of the question's log attention mass (``ub`` from ``mass_direction_ref``) capped at ``limit`` [1]
    nats: where ``|m| > limit``, ``(|m| - limit) * sign(m) / (scale * |ub|^2) * ub`` comes off delta,
    the rest of it stays."""
    ub = mass_direction_ref(q, ok, k, at, cos, sin, segment, mk.shape[0], scale)
    move = scale * (ub * mk).sum(-1)
    over = move.abs() - limit
    cut = torch.where(over > 0, over * move.sign() / (scale * (ub * ub).sum(-1)).clamp(min=1e-30), 0.0)
    return mk - cut[..., None] * ub
