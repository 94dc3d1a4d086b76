"""Where a fused prefill's wall time goes, layer by layer, on a CUDA device (no profiler overhead).

Usage: python3 scripts/profile_fusion_timeline.py OUT_DIR [--shape mistral-7b] [--ratio 0.15]

For each mode (median pass of several): the host's time at each layer's ``get`` of its stored KV,
and on the device the compute stream reaching that point (the previous layer's work done) and the
layer's KV being there. A device time close to the host's says the host was behind (the GPU sat
waiting for launches); far past it says the device set the pace. Beside that: the engine's own
full prefill of the same prompt (``forward_fresh``), which ``full`` should match, and the steady
layers' attention (the selected tokens and the query at their positions) over split counts.
Writes OUT_DIR/timeline.txt and the profiled fuse pass's trace OUT_DIR/fuse-trace.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import random_prompt
from ragfuse.engine.fusion import Segment, SelectionPolicy, fusor
from ragfuse.engine.fusion.prefetch import LayerPrefetcher
from ragfuse.engine.kvstore import MemoryTier, StoredKV, TieredKVStore, kv_key, open_source


class _Stamped(LayerPrefetcher):
    """The fusor's loader, keeping the host time of each ``get`` and itself for reading afterwards."""

    last: _Stamped | None = None

    def get(self, layer: int, ahead: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        self.host.append(time.perf_counter())
        return super().get(layer, ahead)

    def __enter__(self) -> _Stamped:
        self.host: list[float] = []
        _Stamped.last = self
        return super().__enter__()  # type: ignore[return-value]


def timeline(run: Any, repeats: int) -> tuple[float, list[str]]:
    """Median pass of ``run`` (a fused prefill): its wall ms and a per-layer table."""
    fusor.LayerPrefetcher = _Stamped
    passes = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        start.record()
        st = run()
        wall = time.perf_counter() - h0
        lp = _Stamped.last
        assert lp is not None
        rows = [((h - h0) * 1e3, start.elapsed_time(a), start.elapsed_time(b))
                for h, (a, b) in zip(lp.host, lp._waits, strict=False)]
        passes.append((wall, st, rows))
    fusor.LayerPrefetcher = LayerPrefetcher
    wall, st, rows = sorted(passes, key=lambda p: p[0])[len(passes) // 2]
    lines = [f"wall {wall * 1e3:.2f} ms (stats total {st.total_s * 1e3:.2f}, load {st.load_s * 1e3:.2f}, "
             f"wait {st.load_wait_s * 1e3:.2f}); walls {[round(p[0] * 1e3, 2) for p in passes]}",
             "layer  active  host_ms  gpu_asks_ms  gpu_has_ms  layer_gpu_ms  host_lead_ms"]
    for i, (h, a, b) in enumerate(rows):
        nxt = rows[i + 1][1] if i + 1 < len(rows) else wall * 1e3
        act = st.active_per_layer[i] if i < len(st.active_per_layer) else -1
        lines.append(f"{i:5d}  {act:6d}  {h:7.2f}  {a:11.2f}  {b:10.2f}  {nxt - b:12.3f}  {a - h:12.2f}")
    return wall * 1e3, lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, model="smollm2-135m-instruct",
                              device="cuda")
    eng = _engine(args, a.shape)
    chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
    kvs = eng.compute_kv(chunks)
    keys = [kv_key(eng.fingerprint, eng.dtype, c) for c in chunks]
    entries = [StoredKV.from_kv(k, kk, vv) for k, (kk, vv) in zip(keys, kvs, strict=True)]
    tier = MemoryTier("cpu", "cpu", sum(e.nbytes for e in entries) * 2, pin=True)
    for e in entries:
        tier.put(e, keep_evicted=False)
    store = TieredKVStore([tier])
    policy = SelectionPolicy.default().with_ratio(a.ratio)
    ids = [t for c in chunks for t in c] + query

    def once(mode: str, ratio: float) -> Any:
        segs = [Segment(c, open_source(store, k) if mode != "full" else None) for c, k in zip(chunks, keys)]
        segs.append(Segment(query))
        with eng.borrowed_blocks([ids]) as (table,):
            return eng.runner.fused_prefill(table, segs, mode, policy.with_ratio(ratio))[1]

    lines: list[str] = []
    for mode, ratio in (("fuse", a.ratio), ("reuse", 0.0), ("prefix", 0.0), ("full", 0.0), ("fuse", a.ratio)):
        for _ in range(2):
            once(mode, ratio)
        _, tl = timeline(lambda m=mode, r=ratio: once(m, r), a.repeats)
        lines += [f"\n== {a.shape} {mode}@{ratio}", *tl]
        print("\n".join(lines[-len(tl) - 1:][:2]), flush=True)
        (out / "timeline.txt").write_text("\n".join(lines) + "\n")
    walls = []
    for _ in range(a.repeats + 2):
        with eng.borrowed_blocks([ids]) as tables:
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.runner.forward_fresh([ids], tables)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
    lines.append(f"\n== engine forward_fresh of the {len(ids)}-token prompt: median {statistics.median(walls[2:]):.2f} "
                 f"ms ({[round(w, 2) for w in walls]})")
    print(lines[-1], flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once("fuse", a.ratio)
    prof.export_chrome_trace(str(out / "fuse-trace.json"))  # every kernel's start and length, for gaps
    lines += ["\n== fuse kernels (one pass under the profiler)",
              prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)]
    (out / "timeline.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
