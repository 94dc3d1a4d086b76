"""The stale shift measured on a uniform random sample of each passage instead of the selected tokens.

The shipped shift moves a passage's stale KV by half the mean deviation of its recomputed tokens,
which are its most deviating ones (a biased sample, hence the share of 0.5). Here a share ``frac`` of
the recompute budget goes to tokens drawn uniformly at random at the first check layer (forced to
stay active to the end, the rest of the budget ranked as shipped), and the shift is the mean over
those random tokens alone, times ``share``. On CPU through the torch reference (the engine's
``check_keep``, ``front`` and ``segment_shift`` wrapped), scored by teacher-forced KL from full prefill:

    nice .venv/bin/python scripts/stale_shift_sampled.py --dataset musique_dev.json --cases 54,20,21
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import torch
from study_cases import study_cases

import ragfuse.engine.fusion.fusor as fusor
import ragfuse.engine.fusion.layer_step as layer_step
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.quality import mode_kl

STATE: dict[str, Any] = {"cfg": None, "first": True, "sample": None, "positions": None}
SHIPPED = {"front": layer_step.front, "shift": layer_step.segment_shift, "check": fusor.check_keep}


def front(layer: Any, kv: Any, rotary: Any, stored: Any, hidden: Any, residual: Any, positions: torch.Tensor,
          slots: Any, shift: Any = None, keep: bool = True) -> Any:
    """The engine's ``front``, noting the active tokens' positions for the shift."""
    STATE["positions"] = positions
    return SHIPPED["front"](layer, kv, rotary, stored, hidden, residual, positions, slots, shift, keep)


def check(metric: str, weight_exp: float, fresh: Any, stored: Any, rows: torch.Tensor, positions: torch.Tensor,
          must_keep: torch.Tensor, weight: Any, total: int, count: Any, valid: Any = None) -> torch.Tensor:
    """The engine's ``check_keep``; at the first check, a random sample of candidates forced in first."""
    cfg = STATE["cfg"]
    if cfg is not None and STATE["first"]:
        STATE["first"] = False
        cand = (~must_keep.index_select(0, positions)).nonzero().flatten()
        m = round(cfg["frac"] * cfg["ratio"] * cand.numel())
        pick = cand[torch.randperm(cand.numel(), generator=torch.Generator().manual_seed(1234))[:m]]
        STATE["sample"] = positions[pick]
        must_keep[positions[pick]] = True
    return SHIPPED["check"](metric, weight_exp, fresh, stored, rows, positions, must_keep, weight, total, count, valid)


def shift(index: Any, k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor, v_st: torch.Tensor) -> Any:
    """The engine's ``segment_shift`` over the sampled rows only (the others count toward the spare segment)."""
    cfg = STATE["cfg"]
    if cfg is not None and STATE["sample"] is not None:
        spare = torch.full_like(index.active_segment, index.num_segments - 1)
        sampled = torch.isin(STATE["positions"], STATE["sample"])
        index = replace(index, active_segment=torch.where(sampled, index.active_segment, spare),
                        share=torch.tensor([cfg["share"]] * 2, dtype=index.share.dtype))
    return SHIPPED["shift"](index, k_new, v_new, k_st, v_st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="file under ../shared/data, or a path")
    ap.add_argument("--cases", required=True, help="comma-separated case indices")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--variants", default="0.2:0.5,0.2:0.75,0.2:1,0.33:0.5,0.33:0.75,0.33:1",
                    help="comma-separated FRAC:SHARE (budget share sampled, shift share)")
    args = ap.parse_args()
    engine, cases = study_cases(args.dataset, args.cases)
    picks = args.cases.split(",")
    layer_step.front, layer_step.segment_shift, fusor.check_keep = front, shift, check
    variants: dict[str, dict[str, float] | None] = {"shipped": None}
    for spec in args.variants.split(","):
        frac, share = (float(x) for x in spec.split(":"))
        variants[f"sample{frac:g}-share{share:g}"] = {"frac": frac, "ratio": args.ratio, "share": share}
    # the K shift's mass cap off, as when this study's figures were taken
    policy = replace(SelectionPolicy.default(), k_mass_cap=0.0).with_ratio(args.ratio)
    totals = dict.fromkeys(variants, 0.0)
    for i, case in cases:
        row = {}
        for name, cfg in variants.items():
            STATE.update(cfg=cfg, first=True, sample=None)
            row[name] = round(mode_kl(engine, case, "fuse", policy)[1], 5)
            totals[name] += row[name] / len(picks)
        print(json.dumps({"case": i, "kl_tf": row}), flush=True)
    print(json.dumps({"mean_kl_tf": {k: round(v, 5) for k, v in totals.items()}}))


if __name__ == "__main__":
    main()
