"""Where a fused prefill's wall time goes, layer by layer, on a CUDA device (no profiler overhead).

Usage: python3 scripts/profile_fusion_timeline.py OUT_DIR [--shape mistral-7b] [--ratio 0.15]

For each mode (median pass of several): the host's time at each layer's ``get`` of its stored KV,
and on the device the compute stream reaching that point (the previous layer's work done) and the
layer's KV being there. A device time close to the host's says the host was behind (the GPU sat
waiting for launches); far past it says the device set the pace. Beside that: the engine's own
full prefill of the same prompt (``forward_fresh``), which ``full`` should match, and the steady
layers' attention (the selected tokens and the query at their positions) over split counts.
Writes OUT_DIR/timeline.txt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ragfuse.bench.fusion import _engine, random_prompt
from ragfuse.engine.fusion import Segment, SelectionPolicy, fusor
from ragfuse.engine.fusion.prefetch import LayerPrefetcher
from ragfuse.engine.kvstore import MemoryTier, StoredKV, TieredKVStore, kv_key, open_source


class _Stamped(LayerPrefetcher):
    """The fusor's loader, keeping the host time of each ``get`` and itself for reading afterwards."""

    last: _Stamped | None = None

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.host.append(time.perf_counter())
        return super().get(layer)

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


def attention_splits(eng: Any, n: int, active: int, query: int) -> list[str]:
    """The steady layers' attention alone: ``active`` queries (the last ``query`` positions and the
    rest spread over the prompt) over ``n`` keys, per split count and least share."""
    from ragfuse.kernels import paged_attention_triton as pat

    mc = eng.model_config
    dev = eng.device
    bs = eng.runner.kv_cache.layers[0][0].shape[1]
    blocks = -(-n // bs)
    kc = torch.randn(blocks, bs, mc.num_kv_heads, mc.head_dim, device=dev, dtype=eng.dtype)
    vc = torch.randn_like(kc)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    g = torch.Generator().manual_seed(0)
    spread = torch.randperm(n - query - 512, generator=g)[: active - query] + 512
    pos = torch.cat([spread.sort().values, torch.arange(n - query, n)]).to(dev)
    q = torch.randn(active, mc.num_heads, mc.head_dim, device=dev, dtype=eng.dtype)
    bounds = torch.tensor([0, active, n], dtype=torch.int32, device=dev)
    lines = [f"attention {active} queries at positions over {n} keys (us, median of 50):"]
    keep = pat._prefill_min_share
    for share in (2048, 1024, 512, 256):
        pat._prefill_min_share = lambda d, s=share: s
        for splits in (1, 2, 4, 8):
            def call(s: int = splits) -> None:
                pat.paged_prefill_attention_triton(q, kc, vc, table, bounds[2:], bounds[:2], mc.head_dim**-0.5,
                                                   max_query_len=active, q_positions=pos, num_splits=s)
            call()
            ts = []
            for _ in range(50):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            lines.append(f"  min_share {share:5d} splits {splits}: {statistics.median(ts):7.1f}")
    pat._prefill_min_share = keep
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-attention", action="store_true")
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

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once("fuse", a.ratio)
    lines += ["\n== fuse kernels (one pass under the profiler)",
              prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)]
    if not a.no_attention:
        st = once("fuse", a.ratio)
        lines += attention_splits(eng, len(ids), st.active_per_layer[-1], len(query))
        print("\n".join(lines[-17:]), flush=True)
    (out / "timeline.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
