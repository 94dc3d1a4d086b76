"""Where a disk-tier pass that loads only its exact prefix waits (fuse at r = 100%, the controller's choice for
this disk, and prefix): per layer, when its read ran (host clock, ms from the pass's entry; the file read and the
checksum apart), when the host asked for it, and how long the GPU then sat waiting for it; with and without the
readers' read-ahead hints (``prefetch.READ_AHEAD`` layers: 8 shipped, 4, none), and fuse at 15% (every chunk
loaded) likewise. Random-weight SHAPE, 6 x 512 + 32 tokens, page cache
dropped before each pass as in `bench fusion`. Usage: disk_waits.py [SHAPE] [PASSES]
Ran at c8a008a and c8ca5a8, whose loader asked disk sources to fetch layers ahead (``prefetch.READ_AHEAD``,
``prefetch._hints``, ``LayerSource.read_ahead``: POSIX_FADV_WILLNEED); that was measured and dropped (README.md in
this folder), so this script needs one of those commits to run."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy, fusor, prefetch
from ragfuse.engine.kvstore import DiskTier, disk, entry

shape = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 5
device = "cuda" if torch.cuda.is_available() else "cpu"
args = argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, device=device, model=None)
eng = _engine(args, shape)
chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
prompt = StoredPrompt(eng, chunks, query)
tmp = tempfile.mkdtemp(prefix="disk-waits-")
prompt.keep_in(DiskTier(Path(tmp) / "kv", prompt.kv_bytes * 2, reserve_bytes=0))

T0 = [0.0]
EV: list[tuple] = []  # (what, layer or -1, thread, start_ms, end_ms)
lock = threading.Lock()


def timed(what, fn, layer_of=None):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                EV.append((what, layer_of(a) if layer_of else -1, threading.current_thread().name[-1:],
                           (t - T0[0]) * 1e3, (time.perf_counter() - T0[0]) * 1e3))
    return wrapper


disk.DiskEntryReader._readinto = timed("io", disk.DiskEntryReader._readinto)
entry.EntryMeta.verify_layer = timed("verify", entry.EntryMeta.verify_layer, lambda a: a[1])
prefetch._read_layer = timed("read", prefetch._read_layer, lambda a: a[1])
loaders = []
orig_init, orig_get = prefetch.LayerPrefetcher.__init__, prefetch.LayerPrefetcher.get


def init(self, *a, **k):
    orig_init(self, *a, **k)
    loaders.append(self)


prefetch.LayerPrefetcher.__init__ = init
prefetch.LayerPrefetcher.get = timed("get", orig_get, lambda a: a[1])
orig_fuse = fusor.fuse_prefill


def fuse(*a, **k):
    T0[0] = time.perf_counter()
    return orig_fuse(*a, **k)


from ragfuse.engine import model_runner  # noqa: E402

model_runner.fuse_prefill = fuse
pol = SelectionPolicy.default()
out = {}
shipped_hints, shipped_ahead = prefetch._hints, prefetch.READ_AHEAD
VARIANTS = [(8, 2, "fuse", 1.0), (0, 2, "fuse", 1.0), (4, 2, "fuse", 1.0), (8, 2, "prefix", 0.0), (0, 2, "prefix", 0.0),
            (8, 2, "fuse", 0.15), (0, 2, "fuse", 0.15), (4, 2, "fuse", 0.15), (8, 2, "fuse", 1.0)]
for ahead, readers, mode, ratio in VARIANTS:  # ahead: READ_AHEAD (0: no hints)
    prefetch.READERS, prefetch._reader_pool, prefetch.READ_AHEAD = readers, None, ahead or shipped_ahead
    prefetch._hints = shipped_hints if ahead else (lambda layer, num_layers: (range(0), range(0)))
    prompt.run("disk", mode, pol.with_ratio(ratio))  # warm-up (captures)
    runs = []
    for _ in range(passes):
        EV.clear()
        loaders.clear()
        st = prompt.run("disk", mode, pol.with_ratio(ratio))
        ld = loaders[-1]
        waits = [round(a.elapsed_time(h), 3) for a, h in ld._waits] if ld._stream is not None else []
        per = {}
        for what, layer, th, s, e in EV:
            if what in ("read", "get", "verify"):
                per.setdefault(layer, {})[what] = (round(s, 2), round(e, 2), th)
        runs.append({"total_ms": round(st.total_s * 1e3, 2), "load_ms": round(st.load_s * 1e3, 2),
                     "wait_ms": round(st.load_wait_s * 1e3, 2), "waits_per_layer_ms": waits,
                     "io_ms": [round(e - s, 2) for w, _, _, s, e in EV if w == "io"],
                     "layers": {str(k): v for k, v in sorted(per.items())}})
    out[f"{mode}@{ratio} readers={readers} read_ahead={ahead}"] = runs
    best = sorted(runs, key=lambda r: r["total_ms"])[len(runs) // 2]
    print(mode, ratio, f"readers={readers} read_ahead={ahead}", "median pass:", best["total_ms"], "ms, load",
          best["load_ms"],
          "wait", best["wait_ms"],
          "\n  waits per layer:", best["waits_per_layer_ms"],
          "\n  io ms:", best["io_ms"][:40], "\n  io median", statistics.median(best["io_ms"]), flush=True)
print(json.dumps(out))
