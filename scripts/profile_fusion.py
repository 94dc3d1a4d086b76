"""Profile one fused prefill on a CUDA device: where the time of ``fuse`` goes beyond its GPU work.

Usage: python3 scripts/profile_fusion.py OUT_DIR [--shape mistral-7b] [--ratio 0.15] [--tier cpu] [--variants]
``--variants`` also times ``fuse`` with each part of the shipped selection turned off in turn (what each
costs). Writes OUT_DIR/profile-<mode>.txt (top kernels by GPU time, top host ops, sync counts, GPU busy vs
wall time) and a gzipped Chrome trace of the fuse run. Random weights of a real shape, as the bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import random_prompt
from ragfuse.engine.fusion import Segment, SelectionPolicy
from ragfuse.engine.kvstore import MemoryTier, StoredKV, TieredKVStore, kv_key, open_source

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
            "cudaMemcpy", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--tier", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--variants", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(chunks=a.chunks, chunk_tokens=a.chunk_tokens, query_tokens=a.query_tokens,
                              model="smollm2-135m-instruct", device="cuda")
    eng = _engine(args, a.shape)
    mc = eng.model_config
    chunks, query = random_prompt(mc.vocab_size, a.chunks, a.chunk_tokens, a.query_tokens)
    kvs = eng.compute_kv(chunks)
    keys = [kv_key(eng.fingerprint, eng.dtype, c) for c in chunks]
    entries = [StoredKV.from_kv(k, kk, vv) for k, (kk, vv) in zip(keys, kvs, strict=True)]
    tier = MemoryTier(a.tier, "cpu" if a.tier == "cpu" else eng.device, sum(e.nbytes for e in entries) * 2,
                      pin=a.tier == "cpu")
    for e in entries:
        tier.put(e, keep_evicted=False)
    store = TieredKVStore([tier])
    policy = SelectionPolicy.default().with_ratio(a.ratio)

    def once(mode: str, pol: SelectionPolicy = policy):
        segs = [Segment(c, open_source(store, k) if mode != "full" else None) for c, k in zip(chunks, keys)]
        segs.append(Segment(query))
        with eng.borrowed_blocks([[t for s in segs for t in s.token_ids]]) as (table,):
            return eng.runner.fused_prefill(table, segs, mode, pol)[1]

    off = {"shift": {"stale_shift": 0.0}, "revert": {"revert_dropped": False},
           "attention weight": {"attention_weight": 0.0},
           "all three": {"stale_shift": 0.0, "revert_dropped": False, "attention_weight": 0.0}}
    runs = [(m, m, policy) for m in ("full", "reuse", "fuse")]
    if a.variants:
        runs += [(f"fuse without {k}", "fuse", dataclasses.replace(policy, **v)) for k, v in off.items()]
    report = []
    for name, mode, pol in runs:
        for _ in range(2):
            once(mode, pol)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            st = once(mode, pol)
            times.append(time.perf_counter() - t)
        report.append(f"{name}: wall median {statistics.median(times) * 1e3:.1f} ms  total {st.total_s * 1e3:.1f} "
                      f"load {st.load_s * 1e3:.1f} wait {st.load_wait_s * 1e3:.1f} ms  active/layer "
                      f"{st.active_per_layer[:5]}..{st.active_per_layer[-1]}")
        print(report[-1], flush=True)
    for mode in ("fuse", "full"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            once(mode)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        ka = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        lines = [*report, f"\n== {a.shape} {mode}@{a.ratio} tier {a.tier}: wall {wall * 1e3:.1f} ms, "
                 f"GPU kernel time {gpu_us / 1e3:.1f} ms ({gpu_us / 1e4 / wall:.0f}% busy)"]
        lines.append("\n-- host sync-ish ops (count, cpu total ms):")
        for e in ka:
            if e.key in SYNC_OPS:
                lines.append(f"  {e.key:32s} {e.count:6d} {e.cpu_time_total / 1e3:8.2f}")
        lines.append("\n-- top GPU kernels by self device time:")
        lines.append(ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
        lines.append("\n-- top ops by CPU time:")
        lines.append(ka.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
        (out / f"profile-{mode}.txt").write_text("\n".join(lines))
        if mode == "fuse":
            trace = out / "trace-fuse.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
    print("\n".join(report))


if __name__ == "__main__":
    main()
