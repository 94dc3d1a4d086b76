"""The loading controller of CacheBlend (section 5.1), driven by a measured ``DelayProfile``.

Two questions, two answers:
- given where a context's KV lies, which recompute ratio costs no extra delay? Loading and selective
  recompute are pipelined layer by layer, so recomputing is free while it is no slower than loading:
  r = max(r*, r_balanced) with T_recompute(r_balanced, L) = T_load(L, tier), where
  T_recompute(r, L) = curve(r) x Prefill(L), the curve measured by fused passes at several ratios
  (the paper's r x Prefill(L) leaves out a fused pass's fixed part: its check layers run every token,
  and it took ~25% of a full prefill at r = 15%), and T_load(L, tier) = KV bytes per token x L /
  bandwidth(tier); r* is the least ratio that keeps quality (15% in the paper);
- where should a context's KV be stored? In the cheapest configured tier whose T_load does not
  exceed T_recompute(r*, L): any faster tier would cost more and save nothing.
Where loading a whole context is what holds the answer back (a tier slower than recomputing r*), loading only
its first k stored pieces may beat both loading all and recomputing all: the other pieces are computed in full
(exactly, behind what precedes them) while the first k load. Given the pieces' sizes, ``decide`` estimates each k
with the same curve, as a pass whose recomputed share of the stored tokens is that of the pieces computed plus
r of the ones loaded (measured on an H200, disk tier, Yi-34B shape, 6 x 512 tokens: loading 3 took 222-256 ms,
against 304 ms for the exact prefix alone and 541 ms for all six).
Each answer is a ``LoadingDecision`` carrying its estimates, so callers can show why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from .entry import KVStoreError
from .profile import DelayProfile

DEFAULT_R_STAR = 0.15
# USD per GB-hour, rough cloud list prices (HBM share of a GPU-hour, DRAM, NVMe, managed Redis);
# every value is configurable, these only order the tiers sensibly out of the box.
DEFAULT_COST_PER_GB_HOUR = {"gpu": 0.05, "cpu": 0.005, "disk": 0.0001, "redis": 0.002}


@dataclass(frozen=True)
class TierEstimate:
    tier: str
    t_load_s: float
    storage_cost: float  # for the decision's number of tokens and hours
    hides_behind_recompute: bool  # T_load <= T_recompute(r*)


@dataclass(frozen=True)
class LoadingDecision:
    num_tokens: int
    tier: str
    recompute_ratio: float
    r_star: float
    r_balanced: float  # ratio at which recompute takes exactly as long as loading from `tier`
    t_prefill_s: float  # full prefill of num_tokens
    t_recompute_s: float  # at recompute_ratio
    t_load_s: float
    ttft_estimate_s: float  # loading and recompute pipelined: the slower of the two (recompute all: no load)
    reason: str
    estimates: list[TierEstimate] = field(default_factory=list)
    # how many leading stored pieces to load, the rest computed in full; None: all of them (or, at ratio 1,
    # only an exact prefix). recompute_ratio is then the share of the loaded pieces' fusable tokens
    loaded_sources: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class LoadingController:
    def __init__(self, profile: DelayProfile, r_star: float = DEFAULT_R_STAR,
                 cost_per_gb_hour: dict[str, float] | None = None) -> None:
        if not 0.0 < r_star <= 1.0:
            raise KVStoreError(f"r* must be in (0, 1], got {r_star}")
        self.profile = profile
        self.r_star = r_star
        self.cost_per_gb_hour = {**DEFAULT_COST_PER_GB_HOUR, **(cost_per_gb_hour or {})}

    def t_recompute(self, ratio: float, num_tokens: int) -> float:
        return self.profile.recompute_s(ratio, num_tokens)

    def t_load(self, num_tokens: int, tier: str) -> float:
        return self.profile.load_s(num_tokens, tier)

    def storage_cost(self, num_tokens: int, tier: str, hours: float) -> float:
        if tier not in self.cost_per_gb_hour:
            raise KVStoreError(f"no cost per GB-hour configured for tier {tier!r}")
        return self.profile.kv_bytes_per_token * num_tokens / 1e9 * self.cost_per_gb_hour[tier] * hours

    def decide(self, num_tokens: int, tier: str, hours: float = 1.0, _why: str = "", *,
               sources: Sequence[int] = (), exact_prefix: bool = False) -> LoadingDecision:
        """The recompute ratio for a context of ``num_tokens`` whose KV is in ``tier``. ``sources``: the
        token counts of its stored pieces in prompt order (summing to ``num_tokens``), the first an exact
        prefix (never recomputed) where ``exact_prefix``; with them the decision may load only the first
        few (module docstring)."""
        if num_tokens < 1:
            raise KVStoreError(f"a context needs at least one token, got {num_tokens}")
        if sources and sum(sources) != num_tokens:
            raise KVStoreError(f"the stored pieces hold {sum(sources)} tokens, not {num_tokens}")
        prefill = self.profile.prefill_s(num_tokens)
        t_load = self.t_load(num_tokens, tier)
        r_bal = 1.0 if t_load >= prefill else self.profile.ratio_for(t_load, num_tokens)
        ratio = max(self.r_star, r_bal)
        if r_bal >= 1.0:
            why = (f"loading from {tier} ({t_load * 1e3:.2f} ms) is no faster than recomputing every token: "
                   "recompute all")
        elif r_bal > self.r_star:
            why = (f"loading from {tier} takes {t_load * 1e3:.2f} ms, as long as recomputing {r_bal:.1%}: "
                   "recompute that much for free")
        else:
            why = f"loading from {tier} ({t_load * 1e3:.2f} ms) hides behind recomputing r* = {self.r_star:.0%}"
        t_rec = self.t_recompute(ratio, num_tokens)
        # recomputing every token loads nothing but the exact prefix (a pass's first segment), whose
        # load hides behind the rest: the delay is the recompute's alone, not the whole load's
        ttft = t_rec if ratio >= 1.0 else max(t_rec, t_load)
        decision = LoadingDecision(
            num_tokens=num_tokens, tier=tier, recompute_ratio=ratio, r_star=self.r_star, r_balanced=r_bal,
            t_prefill_s=prefill, t_recompute_s=t_rec, t_load_s=t_load, ttft_estimate_s=ttft,
            reason=f"{_why}{why}", estimates=self.estimates(num_tokens, list(self.profile.bandwidth), hours),
        )
        if t_load <= self.t_recompute(self.r_star, num_tokens):
            return decision  # the whole load already hides: loading less would only recompute more
        partial = min((self._load_first(k, sources, exact_prefix, tier) for k in range(1, len(sources))),
                      key=lambda d: d[3], default=None)
        if partial is None or partial[3] >= ttft:
            return decision
        k, r, t_load_k, ttft_k, t_rec_k = partial
        return replace(decision, recompute_ratio=r, t_recompute_s=t_rec_k, t_load_s=t_load_k, ttft_estimate_s=ttft_k,
                       loaded_sources=k, reason=(
                           f"{_why}loading all {len(sources)} stored pieces from {tier} ({t_load * 1e3:.2f} ms) "
                           f"holds the answer back: the first {k} load ({t_load_k * 1e3:.2f} ms) while the other "
                           f"{len(sources) - k} are computed in full, {r:.0%} of the loaded ones recomputed "
                           f"(~{ttft_k * 1e3:.1f} ms, against ~{ttft * 1e3:.1f} ms)"))

    def _load_first(self, k: int, sources: Sequence[int], exact_prefix: bool, tier: str,
                    ) -> tuple[int, float, float, float, float]:
        """(k, ratio, T_load, TTFT, T_recompute) of loading the first ``k`` stored pieces: the pass is
        estimated as one recomputing the pieces left out plus ``ratio`` of the loaded ones' fusable tokens,
        where ``ratio`` is r*, raised until the recompute takes as long as the load (1 where nothing loaded is
        fusable: an exact prefix alone, as in a decision to recompute all)."""
        total = sum(sources)
        fusable = sources[1:] if exact_prefix else sources
        loaded = sum(fusable[: k - 1 if exact_prefix else k]) / sum(fusable) if sum(fusable) else 0.0
        t_load = self.t_load(sum(sources[:k]), tier)
        ratio = self.r_star if loaded else 1.0
        if loaded and self.t_recompute(1.0 - (1.0 - ratio) * loaded, total) < t_load:
            balanced = self.profile.ratio_for(t_load, total)  # the share whose recompute fills the load
            ratio = min(1.0, max(ratio, 1.0 - (1.0 - balanced) / loaded))
        t_rec = self.t_recompute(1.0 - (1.0 - ratio) * loaded, total)
        return k, ratio, t_load, max(t_load, t_rec), t_rec

    def estimates(self, num_tokens: int, tiers: Sequence[str], hours: float) -> list[TierEstimate]:
        budget = self.t_recompute(self.r_star, num_tokens)
        return [
            TierEstimate(t, self.t_load(num_tokens, t), self.storage_cost(num_tokens, t, hours),
                         self.t_load(num_tokens, t) <= budget)
            for t in tiers
        ]

    def choose_tier(self, num_tokens: int, tiers: Sequence[str] | None = None, hours: float = 1.0) -> LoadingDecision:
        """Where to keep a context of ``num_tokens`` for ``hours``: the cheapest tier whose load hides
        behind recomputing r*; if none does, the fastest one (the delay is then the load's)."""
        tiers = list(tiers) if tiers is not None else list(self.profile.bandwidth)
        if not tiers:
            raise KVStoreError("no tiers to choose from")
        est = self.estimates(num_tokens, tiers, hours)
        fitting = [e for e in est if e.hides_behind_recompute]
        if fitting:
            best = min(fitting, key=lambda e: (e.storage_cost, e.t_load_s))
            why = f"{best.tier} is the cheapest of the tiers whose load hides behind r*: "
        else:
            best = min(est, key=lambda e: e.t_load_s)
            why = f"no tier loads within T_recompute(r*); {best.tier} is the fastest: "
        decision = self.decide(num_tokens, best.tier, hours, _why=why)
        return LoadingDecision(**{**decision.__dict__, "estimates": est})
