"""Passages' KV stored after the instruction prefix (ingest's default) vs alone: reuse and fuse against full prefill.

CacheBlend stores each chunk's KV computed as if the chunk started a sequence, so its first token
carries the attention-sink role and every token misses the instruction it will follow. A store's
default chunk KV context computes each passage after the prompt's instruction prefix instead
(``ragfuse/chunk_kv.py``); both storages run the same fused prefills and greedy answers on the same cases.

    nice .venv/bin/python scripts/prefixed_kv_study.py --dataset musique_dev.json --limit 12

Full prefill's answers and logits are cached as ``scripts/selection_study.py`` caches them.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from selection_study import cached_case

from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import load_dataset, run_mode, token_f1
from ragfuse.prompt import RagPromptBuilder
from ragfuse.shared_data import shared_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="musique_dev.json")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--cache", default="/tmp/ragfuse-selection-study")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(device="cpu"))
    builder = RagPromptBuilder(engine.tokenizer)
    examples = load_dataset(shared_data(args.dataset), args.limit, 6)
    alone, prefixed = ([cached_case(engine, builder, ex, f"{Path(args.dataset).stem}-{i}", 16, Path(args.cache),
                                    context) for i, ex in enumerate(examples)] for context in ("none", "instruction"))
    shipped = SelectionPolicy.default()
    variants = [("reuse", "reuse", SelectionPolicy()), ("fuse", "fuse", shipped),
                ("fuse-paper", "fuse", SelectionPolicy.paper(shipped.ratio))]
    variants += [(f"fuse stale_shift={x}", "fuse", replace(shipped, stale_shift=x)) for x in (0.0, 0.25)]
    for storage, cases in (("alone", alone), ("after prefix", prefixed)):
        for label, mode, policy in variants:
            if storage == "alone" and "stale_shift" in label:
                continue
            outs = [run_mode(engine, c, mode, policy, 16) for c in cases]
            fulls = [engine.tokenizer.decode(c.answer_ids, skip_special_tokens=True).strip() for c in cases]
            f1 = sum(token_f1(o["answer"], f) for o, f in zip(outs, fulls, strict=True)) / len(cases)
            print(f"{storage:12} {label:22} kl_first {sum(o['kl_first'] for o in outs) / len(outs):.4f} "
                  f"kl_tf {sum(o['kl_tf'] for o in outs) / len(outs):.4f} f1_full {f1:.3f} (n={len(cases)})",
                  flush=True)


if __name__ == "__main__":
    main()
