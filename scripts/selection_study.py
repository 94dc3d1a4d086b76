"""Compare recompute selections on the same cases by teacher-forced KL from full prefill.

Each case (stored passages, full prefill's answer and logits) is built once; every policy then runs
one fused prefill on it. Cheaper than ``ragfuse eval qa`` per policy (no greedy answers, no
repeated full prefill), so it is what picks the shipped selection's settings.

    nice .venv/bin/python scripts/selection_study.py --dataset musique_dev.json --limit 10 \
        --policy paper --policy default --policy 'check_layers=1,2,3;first_factor=2;sink_tokens=2'
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch

from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import load_dataset
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import Case, build_case, mode_kl, stored_segments
from ragfuse.shared_data import shared_data


def parse_policy(spec: str, ratio: float) -> SelectionPolicy:
    """``paper``, ``default`` or ``field=value;...`` over SelectionPolicy's fields (on the default)."""
    if spec == "paper":
        return SelectionPolicy.paper(ratio)
    base = SelectionPolicy.default().with_ratio(ratio)
    if spec == "default":
        return base
    kinds = {f.name: f.type for f in fields(SelectionPolicy)}
    kw: dict[str, object] = {}
    for part in spec.split(";"):
        key, value = part.split("=", 1)
        if key not in kinds:
            raise SystemExit(f"unknown policy field {key!r}")
        cur = getattr(base, key)
        if isinstance(cur, tuple):
            kw[key] = tuple(int(x) for x in value.split(",") if x)
        elif isinstance(cur, bool):
            kw[key] = value.lower() in ("1", "true", "yes")
        elif cur is None:  # an optional share unset on the default
            kw[key] = None if value.lower() == "none" else float(value)
        else:
            kw[key] = type(cur)(value)
    return SelectionPolicy(**{**{f.name: getattr(base, f.name) for f in fields(SelectionPolicy)}, **kw})


def cached_case(engine: LLMEngine, builder: RagPromptBuilder, ex, key: str, answer_tokens: int, cache: Path,
                kv_context: str = "instruction") -> Case:
    """Full prefill's answer and logits are kept on disk (they cost two full prefills per case); the
    passages' KV is recomputed (hundreds of MB per case), stored as a store with chunk KV context
    ``kv_context`` holds it."""
    path = cache / f"{key}-{answer_tokens}.pt"
    if path.exists():
        saved = torch.load(path)
        return Case(stored_segments(engine, builder, ex.passages, ex.question, kv_context), saved["answer_ids"],
                    saved["full_logits"])
    case = build_case(engine, builder, ex.passages, ex.question, answer_tokens, kv_context)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"answer_ids": case.answer_ids, "full_logits": case.full_logits}, path)
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", action="append", required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--ratios", default="0.15")
    ap.add_argument("--policy", action="append", required=True)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--cache", default="/tmp/ragfuse-selection-study")
    ap.add_argument("--chunk-kv-context", choices=["instruction", "none"], default="instruction",
                    help="passages' stored KV after the instruction prefix (ingest's default) or alone")
    ap.add_argument("--out", default=None, help="append one JSON line per (dataset, policy, ratio)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(device="cpu"))
    builder = RagPromptBuilder(engine.tokenizer)
    ratios = [float(r) for r in args.ratios.split(",")]
    for ds in args.dataset:
        path = shared_data(ds)
        examples = load_dataset(path, args.offset + args.limit, 6)[args.offset:]
        t0 = time.perf_counter()
        cases = [cached_case(engine, builder, ex, f"{Path(ds).stem}-{args.offset + i}", args.answer_tokens,
                             Path(args.cache), args.chunk_kv_context) for i, ex in enumerate(examples)]
        reuse = [mode_kl(engine, c, "reuse", SelectionPolicy())[1] for c in cases]
        reuse_kl = sum(reuse) / len(reuse)
        print(f"{ds}: {len(cases)} cases built in {time.perf_counter() - t0:.0f}s; reuse kl_tf {reuse_kl:.4f}",
              flush=True)
        for spec in args.policy:
            for r in ratios:
                pol = parse_policy(spec, r)
                t1 = time.perf_counter()
                kls = [mode_kl(engine, c, "fuse", pol) for c in cases]
                kl_tf = sum(k[1] for k in kls) / len(kls)
                kl_first = sum(k[0] for k in kls) / len(kls)
                wins = sum(k[1] < u for k, u in zip(kls, reuse, strict=True))
                row = {"dataset": ds, "policy": spec, "ratio": r, "chunk_kv_context": args.chunk_kv_context,
                       "kl_tf": kl_tf, "kl_first": kl_first,
                       "gap_closed": 1 - kl_tf / reuse_kl, "reuse_kl_tf": reuse_kl, "n": len(cases),
                       "per_case": [k[1] for k in kls], "reuse_per_case": reuse,
                       "s_per_case": (time.perf_counter() - t1) / len(cases)}
                print(f"  {spec:60s} r={r:.2f} kl_tf {kl_tf:.4f} gap {row['gap_closed']:.3f} "
                      f"kl_first {kl_first:.4f} better-than-reuse {wins}/{len(cases)} "
                      f"{row['s_per_case']:.1f}s/case", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
