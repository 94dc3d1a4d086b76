"""TTFT cost of the K shift's mass cap: fuse@15% from the CPU tier with the cap (shipped) and without,
interleaved, on a random-weight shape (bf16, 6 x 512 stored tokens + 32). Usage: capcost.py SHAPE"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import MemoryTier


def cpu_tier_prompt(shape: str) -> StoredPrompt:
    """A random-weight engine of ``shape`` and 6 x 512 + 32 random tokens, their KV in a pinned CPU tier."""
    args = argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, device="cuda", model=None)
    eng = _engine(args, shape)
    chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
    prompt = StoredPrompt(eng, chunks, query)
    prompt.keep_in(MemoryTier("cpu", "cpu", prompt.kv_bytes * 2, pin=True))
    return prompt


def main() -> None:
    prompt = cpu_tier_prompt(sys.argv[1])
    on = SelectionPolicy.default()
    off = replace(on, k_mass_cap=0.0)
    t: dict[str, list[float]] = {"cap": [], "nocap": []}
    for _ in range(3):
        prompt.run("cpu", "fuse", on), prompt.run("cpu", "fuse", off)
    for _ in range(15):
        t["cap"].append(prompt.run("cpu", "fuse", on).total_s)
        t["nocap"].append(prompt.run("cpu", "fuse", off).total_s)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    print(json.dumps({"shape": sys.argv[1], "median_ms": med, "ratio": med["cap"] / med["nocap"],
                      "runs_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in t.items()}}))


if __name__ == "__main__":
    main()
