"""The per-model accuracy gate: the least recompute ratio r* that keeps fusion close to full prefill.

The first time a model is used with fusion, the gate runs the fixed probes (``probes.py``) with full
prefill, full KV reuse and fusion at increasing ratios, and takes as r* the smallest ratio whose
``gap_closed`` (the share of reuse's teacher-forced KL that fusion removes) reaches the target. If
no ratio below 1 does, r* is 1: fusion falls back to full recompute, and the log says so. The
result is cached per model (weights fingerprint) and policy; the loading controller never goes
below it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from ragfuse.engine import LLMEngine
from ragfuse.engine.checkpoint import cache_root
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.probes import PROBES
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import build_case, mode_kl

log = logging.getLogger("ragfuse.gate")
RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7)
DEFAULT_TARGET = 0.6


@dataclass
class Calibration:
    model: str
    policy: dict
    target_gap_closed: float
    r_star: float
    gap_closed: dict[str, float]  # ratio -> gap closed on the probes
    kl_tf_reuse: float
    fallback_to_full: bool


def calibrate(
    engine: LLMEngine, policy: SelectionPolicy | None = None, target: float = DEFAULT_TARGET, answer_tokens: int = 8
) -> Calibration:
    policy = policy or SelectionPolicy.default()
    builder = RagPromptBuilder(engine.tokenizer)
    cases = [build_case(engine, builder, p["passages"], p["question"], answer_tokens) for p in PROBES]  # type: ignore[arg-type]
    reuse = sum(mode_kl(engine, c, "reuse", policy)[1] for c in cases)
    gaps: dict[str, float] = {}
    r_star = 1.0
    for r in RATIOS:
        kl = sum(mode_kl(engine, c, "fuse", policy.with_ratio(r))[1] for c in cases)
        gaps[f"{r:g}"] = 1.0 - kl / reuse if reuse > 0 else 1.0
        if gaps[f"{r:g}"] >= target:
            r_star = r
            break
    fallback = r_star >= 1.0
    if fallback:
        log.warning("fusion does not reach gap_closed %.2f below ratio 1 on %s: falling back to full recompute",
                    target, engine.model_name)
    return Calibration(engine.model_name, asdict(policy), target, r_star, gaps, reuse / len(cases), fallback)


def calibrated_r_star(
    engine: LLMEngine, policy: SelectionPolicy | None = None, target: float = DEFAULT_TARGET
) -> float:
    """r* for this model and policy, from the cache or calibrated now (and cached)."""
    policy = policy or SelectionPolicy.default()
    tag = f"{engine.fingerprint}-{str(engine.dtype).removeprefix('torch.')}-{policy.metric}-" \
          f"{'_'.join(map(str, policy.check_layers))}-{policy.first_factor:g}-{policy.sink_tokens}-{target:g}"
    path = cache_root() / "gate" / f"{tag}.json"
    if path.exists():
        try:
            return float(json.loads(path.read_text())["r_star"])
        except (ValueError, KeyError, OSError):
            log.warning("unreadable gate cache %s: calibrating again", path)
    log.warning("first use of fusion with %s: calibrating r* on %d probes", engine.model_name, len(PROBES))
    cal = calibrate(engine, policy, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cal), indent=2))
    tmp.replace(path)
    log.warning("r* = %.2f for %s (gap closed per ratio: %s)", cal.r_star, engine.model_name, cal.gap_closed)
    return cal.r_star
