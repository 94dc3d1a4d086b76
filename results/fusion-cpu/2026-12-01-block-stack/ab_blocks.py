"""A/B: the block free list as a queue (before) vs a stack (now), CPU, default model, bench fusion's prompt.

Usage: python ab_blocks.py ROUNDS REPEATS OUT.json. Each round builds a fresh engine per variant (fresh cache
pages), runs one untimed pass per mode, then REPEATS passes of full prefill and fuse@15% interleaved, the chunks'
KV in the CPU tier. The queue is the old ``grow`` (oldest block given back first), patched in.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.block_manager import BlockManager
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import MemoryTier


def queue_grow(self: BlockManager, block_table: list[int], num_tokens: int) -> None:
    """``grow`` as it was: the oldest block given back first (no cache evictions needed here)."""
    for _ in range(self.blocks_needed(block_table, num_tokens)):
        block = self.free_ids.pop(0)
        self.ref_counts[block] = 1
        block_table.append(block)


def main() -> None:
    rounds, repeats, out_path = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    stack_grow = BlockManager.grow
    out: dict[str, list[dict]] = {}
    policy = SelectionPolicy.default()
    for rnd in range(rounds):
        for variant in ("queue", "stack"):
            BlockManager.grow = queue_grow if variant == "queue" else stack_grow  # type: ignore[method-assign]
            eng = LLMEngine(EngineConfig(device="cpu", max_model_len=4096))
            if variant == "queue":
                eng.blocks.free_ids.reverse()  # block 0 first, as the queue held them
            chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
            prompt = StoredPrompt(eng, chunks, query)
            prompt.keep_in(MemoryTier("cpu", "cpu", prompt.kv_bytes * 2))
            times: dict[str, list[float]] = {"full": [], "fuse": []}
            for timed in (False, *([True] * repeats)):
                for mode in times:
                    stats = prompt.run("cpu", mode, policy.with_ratio(0.15 if mode == "fuse" else 0.0))
                    if timed:
                        times[mode].append(stats.total_s)
            med = {m: statistics.median(v) for m, v in times.items()}
            out.setdefault(variant, []).append({**times, "speedup": med["full"] / med["fuse"]})
            print(time.strftime("%H:%M:%S"), rnd, variant, {m: [round(x, 2) for x in v] for m, v in times.items()},
                  f"-> {med['full'] / med['fuse']:.2f}x", flush=True)
            del prompt, eng
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
