"""Profile the fused prefill on CPU (default model, the bench's prompt shape): where ``fuse``'s time goes.

Usage: nice .venv/bin/python scripts/profile_fusion_cpu.py OUT_DIR [--ratio 0.15] [--policy default|paper]
Writes OUT_DIR/profile-cpu-<mode>.txt: wall time per mode (median of repeats, side by side) and the
top ops by self CPU time of one ``fuse`` and one ``full`` pass under torch.profiler.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from ragfuse.bench.stored_prompt import random_prompt
from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--policy", default="default", choices=["default", "paper"])
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.chunks * a.chunk_tokens + a.query_tokens
    eng = LLMEngine(EngineConfig(device="cpu", max_model_len=max(n + 64, 4096)))
    chunks, query = random_prompt(eng.model_config.vocab_size, a.chunks, a.chunk_tokens, a.query_tokens)
    kvs = eng.compute_kv(chunks)
    segs = [Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, kvs, strict=True)] + [Segment(query)]
    policy = SelectionPolicy.default().with_ratio(a.ratio) if a.policy == "default" else SelectionPolicy.paper(a.ratio)

    def once(mode: str) -> float:
        with eng.borrowed_blocks([[0] * n]) as (table,):
            t = time.perf_counter()
            eng.runner.fused_prefill(table, segs, mode, policy)
            return time.perf_counter() - t

    once("fuse")  # warm-up
    times: dict[str, list[float]] = {"full": [], "fuse": []}
    for _ in range(a.repeats):  # interleaved, so both modes see the same machine load
        for mode in times:
            times[mode].append(once(mode))
    med = {m: statistics.median(v) for m, v in times.items()}
    head = (f"{time.strftime('%H:%M UTC', time.gmtime())} prompt {n} tokens, ratio {a.ratio}, policy {a.policy}: "
            f"full {med['full']:.2f}s fuse {med['fuse']:.2f}s -> {med['full'] / med['fuse']:.2f}x "
            f"(medians of {a.repeats}: {times})")
    print(head)
    for mode in ("fuse", "full"):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            once(mode)
        table = prof.key_averages(group_by_input_shape=False).table(sort_by="self_cpu_time_total", row_limit=30)
        (out / f"profile-cpu-{mode}.txt").write_text(head + "\n\n" + table)
        print(mode, table, sep="\n")


if __name__ == "__main__":
    main()
