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

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.metric not in ("k", "v", "kv"):
            raise ValueError(f"unknown deviation metric {self.metric!r}")
        if not self.check_layers or min(self.check_layers) < 1:
            raise ValueError("check layers must be >= 1 (layer 0 never deviates)")

    @classmethod
    def default(cls) -> SelectionPolicy:
        """The selection ragfuse ships: gradual filtering over check layers 1-5 by V deviation,
        keeping 3r of the stored tokens after layer 1 and narrowing evenly to r after layer 5.
        The longer funnel costs about half a layer of full prefill more than one check layer, and
        on the default model it removes more of full KV reuse's teacher-forced KL at equal ratio
        (5 MuSiQue cases at r = 15%, ``scripts/selection_study.py``: 55% against 46% for the
        paper's one-check-layer selection, 50% for checks 1-3 from 2r, 53% for checks 1-5 from 2r;
        K+V deviation 48%; sink tokens forced in changed nothing, deviation already picks them)."""
        return cls(ratio=0.15, check_layers=(1, 2, 3, 4, 5), first_factor=3.0, metric="v")

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


def choose(dev: torch.Tensor, keep: int, forced: torch.Tensor, num_forced: int) -> torch.Tensor:
    """Indices of the chosen candidates: the ``forced`` ones plus the highest deviations, ``keep`` in
    all (forced tokens count toward ``keep``; all of them are kept even past it).

    ``num_forced`` (= ``forced.sum()``) comes from the host, so choosing reads nothing back from the
    device: the fusor calls this between layers, where a read-back would stall the GPU queue."""
    take = num_forced + max(0, min(keep - num_forced, dev.shape[0] - num_forced))
    return torch.topk(dev.masked_fill(forced, float("inf")), take).indices


def keep_count(share: float, num_stored: int) -> int:
    return min(num_stored, math.ceil(share * num_stored))
