"""How this folder's ab_load.json was measured (GPU, one process): a disk tier's rate read as `ragfuse profile`
read it before 8c44064 (an entry at a time, one layer after the other, one thread) and as it reads it now (the
fusor's own loader), and disk-tier fused passes' load time as the union of their reads (now) and as their sum
(before), beside each pass's TTFT.

Usage: python3 results/controller-h200-1130/ab_load.py OUT.json mistral-7b
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy, prefetch
from ragfuse.engine.kvstore import DiskTier, TieredKVStore, measure_read_bandwidth, open_source
from ragfuse.engine.kvstore.profile import synthetic_entry

SUMMED: list[float] = []  # each pass's reads summed, as load_s was before
_union = prefetch.LayerPrefetcher.load_s.fget


def _load_s(self: prefetch.LayerPrefetcher) -> float:
    copies = sum(s.elapsed_time(e) for s, e in self._copy_events.values()) / 1e3
    SUMMED.append(sum(end - start for start, end in self._read_spans) + copies)
    return _union(self)


prefetch.LayerPrefetcher.load_s = property(_load_s)


def serial_rate(tier: DiskTier, entries: list, device: torch.device, repeats: int = 3) -> float:
    """The profile's read before: each entry whole, layer after layer, one thread."""
    store = TieredKVStore([tier])
    for e in entries:
        tier.put(e, keep_evicted=False)
    times = []
    for _ in range(repeats):
        for e in entries:
            tier.drop_cache(e.key)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for e in entries:
            src = open_source(store, e.key)
            for layer in range(e.meta.num_layers):
                for t in src.load_layer(layer):
                    t.to(device, non_blocking=True)
            src.finish()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for e in entries:
        tier.delete(e.key)
    return sum(e.nbytes for e in entries) / min(times)


def main() -> None:
    out = {}
    for shape in sys.argv[2:]:
        eng = _engine(argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, device="cuda", model=None), shape)
        mc = eng.model_config
        res = out[shape] = {}
        with tempfile.TemporaryDirectory() as tmp:
            kv = [synthetic_entry(f"p{i}", mc.num_layers, 512, mc.num_kv_heads, mc.head_dim, eng.dtype)
                  for i in range(6)]
            cap = kv[0].nbytes * 8
            res["bw_old_serial"] = [serial_rate(DiskTier(Path(tmp) / f"a{i}", cap, reserve_bytes=0), kv, eng.device)
                                    for i in range(2)]
            res["bw_new_loader"] = [measure_read_bandwidth(DiskTier(Path(tmp) / f"b{i}", cap, reserve_bytes=0), kv,
                                                           eng.device) for i in range(2)]
            chunks, query = random_prompt(mc.vocab_size, 6, 512, 32)
            prompt = StoredPrompt(eng, chunks, query)
            prompt.keep_in(DiskTier(Path(tmp) / "kv", prompt.kv_bytes * 2, reserve_bytes=0))
            policy = SelectionPolicy.default()
            res["kv_bytes"] = prompt.kv_bytes
            res["passes"] = []
            for mode, ratio in (("reuse", 0.0), ("fuse", 0.15)):
                prompt.run("disk", mode, policy.with_ratio(ratio))
                for _ in range(4):
                    st = prompt.run("disk", mode, policy.with_ratio(ratio))
                    res["passes"].append({"mode": mode, "ttft_s": st.total_s, "load_union_s": st.load_s,
                                          "load_summed_s": SUMMED[-1], "wait_s": st.load_wait_s,
                                          "compute_s": st.compute_s})
        print(shape, json.dumps(res, indent=1), flush=True)
        del eng
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
