"""Which stored tokens to recompute: high-KV-deviation (HKVD) selection with gradual filtering.

At each check layer the tokens still active are recomputed and compared with their stored KV;
those that deviate most stay active for the following layers. The first check keeps a slightly
larger share than the target and later checks narrow it (the paper's gradual filtering), so the
final set is the tokens that deviate on several layers, not on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SelectionPolicy:
    ratio: float = 0.15  # share of the stored tokens recomputed after the last check layer
    check_layers: tuple[int, ...] = (1,)  # layer 0's K/V depend on the token alone: never check there
    first_factor: float = 1.0  # the first check keeps first_factor * ratio, narrowing to ratio at the last
    metric: str = "v"  # "k", "v" or "kv": which deviation ranks tokens
    sink_tokens: int = 0  # the first tokens of every stored segment are always recomputed
    attention_weight: float = 0.0  # rank by deviation * (the question's attention to the token) ** this
    revert_dropped: bool = False  # a check layer puts the stored KV back for the candidates it drops
    stale_shift: float = 0.0  # stale KV moves by this share of its segment's mean deviation (``stale_shift.py``)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.metric not in ("k", "v", "kv"):
            raise ValueError(f"unknown deviation metric {self.metric!r}")
        if not 0.0 <= self.stale_shift <= 1.0:
            raise ValueError(f"stale shift must be in [0, 1], got {self.stale_shift}")
        if not self.check_layers or min(self.check_layers) < 1:
            raise ValueError("check layers must be >= 1 (layer 0 never deviates)")

    @classmethod
    def default(cls) -> SelectionPolicy:
        """The selection ragfuse ships: gradual filtering over check layers 1-5, keeping 3r of the
        stored tokens after layer 1 and narrowing evenly to r after layer 5, ranked by V deviation
        lightly weighted by the question's attention (** 0.1); dropped candidates get their stored
        KV back, and every stale token's KV moves by half its segment's mean deviation.

        Measured with ``scripts/selection_study.py`` (teacher-forced KL of each selection on the
        same cases, 6 MuSiQue cases at r = 15%, gap_closed = share of full reuse's KL removed;
        results/fusion-quality/selection-study-6cases.jsonl): the paper's one check layer 0.45;
        this funnel without the shift 0.53 (from 2r 0.52, 4r 0.50, 5r 0.49; checks 1-3 0.51, 1-6
        0.50, 2-6 0.50, 1-8 from 4r 0.48; K+V deviation 0.52; sink tokens forced in: no change,
        deviation already picks them; attention exponent 0.1 0.53, 0.25 0.52, while it lowers the
        first token's KL; deviations summed over checks 0.46); with the stale shift 0.72 (0.71
        without the attention weight; share 0.75 0.72; an earlier variant shifting only past the
        last check: share 0.25 0.64, 0.5 0.68, 1.0 0.65; the paper's one check layer with it 0.59)."""
        return cls(ratio=0.15, check_layers=(1, 2, 3, 4, 5), first_factor=3.0, metric="v", attention_weight=0.1,
                   revert_dropped=True, stale_shift=0.5)

    @classmethod
    def paper(cls, ratio: float) -> SelectionPolicy:
        """The paper's straightforward selection: one check layer, V deviation."""
        return cls(ratio=ratio, check_layers=(1,), first_factor=1.0, metric="v")

    def with_ratio(self, ratio: float) -> SelectionPolicy:
        return replace(self, ratio=ratio)

    def keep_share(self, check_index: int) -> float:
        """Share of stored tokens kept active after check ``check_index`` (0-based)."""
        n = len(self.check_layers)
        factor = self.first_factor if n == 1 else self.first_factor + (1 - self.first_factor) * check_index / (n - 1)
        return min(1.0, self.ratio * factor)


def deviation(
    metric: str, k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor
) -> torch.Tensor:
    """Per-token L2 deviation [tokens] of fresh K/V (before RoPE) from the stored K/V."""
    parts = []
    if metric in ("k", "kv"):
        dk = (k_new.float() - k_old.float()).flatten(1).norm(dim=1)
        parts.append(dk / (k_old.float().flatten(1).norm(dim=1).mean() + 1e-6))
    if metric in ("v", "kv"):
        dv = (v_new.float() - v_old.float()).flatten(1).norm(dim=1)
        parts.append(dv / (v_old.float().flatten(1).norm(dim=1).mean() + 1e-6))
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def question_attention(q_tail: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """How much the prompt's last tokens (the question, computed fresh) attend to each position [n],
    averaged over their heads and themselves: a stored token's KV error reaches the answer mostly
    through the question's attention to it, so a deviation nobody attends to matters little.

    ``q_tail`` [m, H, D] are the queries (rotated) of the last m positions, ``keys`` [n, KVH, D] the
    layer's rotated keys of the whole prompt (fresh for active tokens, stored for the rest).
    Each KV head's group of query heads is one batched product against its keys, in the model's
    dtype: repeating the keys per query head in float32 first (an einsum's way) cost ~0.6 ms per
    check layer on an H100 at 3K tokens, for a weight the policy only raises to a small power."""
    m, heads, dim = q_tail.shape
    n, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    q = q_tail.reshape(m, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, m * group, dim)
    scores = torch.bmm(q, keys.permute(1, 2, 0)).float().view(kv_heads, m, group, n) * scale
    future = torch.arange(n, device=keys.device)[None, :] > torch.arange(n - m, n, device=keys.device)[:, None]
    return scores.masked_fill(future[None, :, None, :], float("-inf")).softmax(-1).mean((0, 1, 2))


def choose(dev: torch.Tensor, keep: int, forced: torch.Tensor, num_forced: int) -> torch.Tensor:
    """Indices of the chosen candidates: the ``forced`` ones plus the highest deviations, ``keep`` in
    all (forced tokens count toward ``keep``; all of them are kept even past it).

    ``num_forced`` (= ``forced.sum()``) comes from the host, so choosing reads nothing back from the
    device: the fusor calls this between layers, where a read-back would stall the GPU queue."""
    take = num_forced + max(0, min(keep - num_forced, dev.shape[0] - num_forced))
    return torch.topk(dev.masked_fill(forced, float("inf")), take).indices


def keep_count(share: float, num_stored: int) -> int:
    return min(num_stored, math.ceil(share * num_stored))
