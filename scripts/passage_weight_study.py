"""Would the recompute budget do better spent on the passages the question reads? A study, not shipped.

The shipped selection ranks a check layer's candidates by V deviation times the question's attention to
the token ** 0.1. This study multiplies that rank by the question's mean attention over the token's
passage ** beta (ranking is unchanged by any common scale, so the mean needs no normalising), by
wrapping ``ops.question_attention`` (the per-position weight the check layers read) for the CPU pass:
weight * passage_mean ** (beta / 0.1), which the selection raises to 0.1. Each case's full prefill
answer and logits are cached as ``selection_study.py`` caches them; each beta runs one fused prefill,
teacher-forced KL along full prefill's answer, then its own 16 greedy tokens (f1_full against full's).

    nice .venv/bin/python scripts/passage_weight_study.py --dataset musique_dev.json --offset 20 --limit 15 \
        --betas 0,0.5,1,2 --out passage-weight.jsonl

Results: results/fusion-quality/passage-weight.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from selection_study import cached_case

from ragfuse.engine import EngineConfig, LLMEngine, ops
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import load_dataset, run_mode, token_f1
from ragfuse.prompt import RagPromptBuilder
from ragfuse.shared_data import shared_data


class PassageWeighted:
    """``ops.question_attention`` with each passage position's weight times its passage's mean ** (beta / aw)."""

    def __init__(self, attention_weight: float) -> None:
        self.question_attention = ops.question_attention
        self.attention_weight = attention_weight
        self.segment: torch.Tensor | None = None  # passage index per prompt position, -1 elsewhere
        self.beta = 0.0

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        w = self.question_attention(*args, **kwargs)
        if not self.beta or self.segment is None:
            return w
        seg = self.segment[: w.shape[0]]
        inside = seg >= 0
        count = int(seg.max()) + 1
        mass = torch.zeros(count, dtype=w.dtype).index_add_(0, seg[inside], w[inside])
        size = torch.zeros(count, dtype=w.dtype).index_add_(0, seg[inside], torch.ones_like(w[inside]))
        factor = torch.ones_like(w)
        factor[inside] = (mass / size.clamp(min=1))[seg[inside]] ** (self.beta / self.attention_weight)
        return w * factor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="musique_dev.json")
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--limit", type=int, default=15)
    ap.add_argument("--betas", default="0,0.5,1,2")
    ap.add_argument("--cache", default="/tmp/ragfuse-selection-study")
    ap.add_argument("--out", default=None, help="append one JSON line per (case, beta)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(device="cpu"))
    builder = RagPromptBuilder(engine.tokenizer)
    policy = SelectionPolicy.default()
    wrapped = PassageWeighted(policy.attention_weight)
    ops.question_attention = wrapped  # the fusor calls it through the module
    examples = load_dataset(shared_data(args.dataset), args.offset + args.limit, 6)[args.offset:]
    betas = [float(b) for b in args.betas.split(",")]
    rows: dict[float, list[dict]] = {b: [] for b in betas}
    for i, ex in enumerate(examples):
        t0 = time.perf_counter()
        index = args.offset + i
        case = cached_case(engine, builder, ex, f"{Path(args.dataset).stem}-{index}", 16, Path(args.cache))
        full = engine.tokenizer.decode(case.answer_ids, skip_special_tokens=True).strip()
        wrapped.segment = torch.tensor([int(s.label.split()[1]) if s.label.startswith("passage") else -1
                                        for s in case.segments for _ in s.token_ids])
        for beta in betas:
            wrapped.beta = beta
            out = run_mode(engine, case, "fuse", policy, 16)
            row = {"dataset": args.dataset, "case": index, "beta": beta, "kl_tf": out["kl_tf"],
                   "kl_first": out["kl_first"], "f1_full": token_f1(out["answer"], full), "answer": out["answer"],
                   "full": full}
            rows[beta].append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        print(f"case {index} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for beta, done in rows.items():
            n = len(done)
            print(f"  beta {beta}: kl_tf {sum(r['kl_tf'] for r in done) / n:.4f} "
                  f"kl_first {sum(r['kl_first'] for r in done) / n:.4f} "
                  f"f1_full {sum(r['f1_full'] for r in done) / n:.3f} (n={n})", flush=True)


if __name__ == "__main__":
    main()
