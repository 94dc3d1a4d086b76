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


def mass_direction_ref(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bounds: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Mean ``u`` [segments, KVH, D] float32 per stored segment and KV head.

    ``q`` [W, H, D]: the question's queries, rotated; ``ok`` [W] bool: which of them count (the rest
    are padding); ``k`` [T, KVH, D]: the stored K before RoPE, at model positions ``at`` [T];
    ``bounds`` [segments + 1]: segment ``s`` is the rows ``bounds[s]:bounds[s + 1]`` (the fused pass
    knows them on the host: they are made once a pass, not found again in every layer).
    The mean is over the real queries and the KV head's query heads; a segment without rows gets
    zeros. Float32 throughout.

    Each segment's softmax and its cos/sin sums are two products over that segment's rows alone, so
    no pass touches a score tensor of the whole prompt (the CPU runs this in every shifted layer of a
    fused pass: the default model's pass at 6 x 512 stored tokens takes ~1.6 ms a layer longer with the
    cap than without, where one score tensor with scattered per-segment max and sum took ~6.3 longer;
    results/fusion-cpu/2026-11-30-cap-ref). The bounds are read on the host: the Triton backend,
    whose CUDA graphs cannot sync, runs ``mass_direction_triton`` instead."""
    w_rows, heads, dim = q.shape
    kv_heads, half = k.shape[1], dim // 2
    group = heads // kv_heads
    qs = (q.float() * ok[:, None, None]).view(w_rows, kv_heads, group, dim).transpose(0, 1)
    qs = qs.reshape(kv_heads, w_rows * group, dim)
    c, s = cos[at].float(), sin[at].float()  # [T, half]
    kt = k.float().transpose(0, 1).contiguous()  # [KVH, T, D]
    # rotated to its positions, as the cache holds it, straight into the [KVH, T, D] layout the per-segment
    # products slice (apply_rope_ref then a transposed copy: the cap cost a CPU pass 126 ms, not 47)
    k_rot = torch.empty_like(kt)
    torch.mul(kt[..., :half], c, out=k_rot[..., :half]).addcmul_(kt[..., half:], s, value=-1)
    torch.mul(kt[..., half:], c, out=k_rot[..., half:]).addcmul_(kt[..., :half], s)
    cs = torch.cat((c, s), dim=-1)
    qk = qs * scale
    ends = bounds.tolist()
    cw = torch.zeros(len(ends) - 1, kv_heads, w_rows * group, dim, device=q.device)  # per row: (C, S)
    for i, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        if b > a:
            w = torch.softmax(torch.bmm(qk, k_rot[:, a:b].transpose(1, 2)), dim=-1)
            torch.matmul(w, cs[a:b], out=cw[i])
    # u = (q1 C + q2 S, q2 C - q1 S) summed over rows: products with q and with (q2, -q1), halves folded
    x = (cw * qs).sum(2)
    y = (cw * torch.cat((qs[..., half:], -qs[..., :half]), dim=-1)).sum(2)
    u = torch.cat((x[..., :half] + x[..., half:], y[..., :half] + y[..., half:]), dim=-1)
    return u / (ok.sum() * group).clamp(min=1)


def cap_k_shift_ref(
    mk: torch.Tensor, q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, bounds: torch.Tensor, limit: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The K shift ``mk`` [segments, KVH, D] float32 with each segment's move ``m = scale * ub . delta``
    of the question's log attention mass (``ub`` from ``mass_direction_ref``) capped at ``limit`` [1]
    nats: where ``|m| > limit``, ``(|m| - limit) * sign(m) / (scale * |ub|^2) * ub`` comes off delta,
    the rest of it stays."""
    ub = mass_direction_ref(q, ok, k, at, cos, sin, bounds, scale)
    move = scale * (ub * mk).sum(-1)
    over = move.abs() - limit
    cut = torch.where(over > 0, over * move.sign() / (scale * (ub * ub).sum(-1)).clamp(min=1e-30), 0.0)
    return mk - cut[..., None] * ub
