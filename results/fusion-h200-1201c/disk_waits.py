"""Where a disk-tier pass's compute waits for its stored KV, layer by layer, with and without read-ahead advice.

Random-weight Mistral-7B shape on CUDA, 6 x 512 stored tokens + 32, the chunks' KV in a disk tier whose page cache
is dropped before every pass (``StoredPrompt.run``, as ``ragfuse bench fusion`` does). Each variant runs ``prefix``
and ``fuse`` five times after a warm-up, variants alternating, ``--rounds`` times over. Variants:
- ``none``: no advice (``READ_AHEAD_BYTES = 0``), only the kernel's own readahead;
- ``shipped``: ``DiskEntryReader.read_ahead`` as it is (a window of i + 2 layers up to 16 MiB, before the read);
- ``flat``: a 16 MiB window from every layer's start (runs 6 and 7 shipped this).
- ``skip0``: as shipped, but the advice asked at layer 0 starts at layer 1, so layer 0 is read alone (run 9).

Usage: disk_waits.py OUT.json [--variants none,shipped] [--rounds 3]
Prints per variant and mode: TTFT, load hidden, load and wait (ms), and the median pass's wait per layer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy, fusor, prefetch
from ragfuse.engine.kvstore import DiskTier
from ragfuse.engine.kvstore import disk as disk_mod

passes: list[Probe] = []


class Probe(prefetch.LayerPrefetcher):
    """The pass's loader, keeping when each layer's read ran (ms from the loader's making)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.t0 = time.perf_counter()
        self.reads_at: dict[int, tuple[float, float]] = {}
        passes.append(self)

    def _read(self, layer):
        t = time.perf_counter()
        r = super()._read(layer)
        self.reads_at[layer] = ((t - self.t0) * 1e3, (time.perf_counter() - self.t0) * 1e3)
        return r


shipped = disk_mod.DiskEntryReader.read_ahead


def flat(self: disk_mod.DiskEntryReader, i: int) -> None:
    """A 16 MiB window from layer ``i``'s start, whatever the layer."""
    if not 0 <= i < len(self._offsets):
        return
    start = self._base + self._offsets[i][0]
    end = min(start + (16 << 20), self._end)
    with contextlib.suppress(OSError, ValueError):
        os.posix_fadvise(self._f.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)


def skip0(self: disk_mod.DiskEntryReader, i: int) -> None:
    """Layer 0 read alone: the advice asked at layer 0 starts at layer 1 (the shipped window from there)."""
    shipped(self, i if i > 0 else 1)


VARIANTS = {"flat": flat, "skip0": skip0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--variants", default="none,shipped")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    fusor.LayerPrefetcher = Probe
    eng = _engine(argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, device="cuda", model=None),
                  "mistral-7b")
    chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
    prompt = StoredPrompt(eng, chunks, query)
    out: dict[str, list[dict]] = {}
    policy = SelectionPolicy.default()
    with tempfile.TemporaryDirectory() as tmp:
        prompt.keep_in(DiskTier(Path(tmp) / "kv", prompt.kv_bytes * 2, reserve_bytes=0))
        for _ in range(a.rounds):
            for variant in a.variants.split(","):
                disk_mod.READ_AHEAD_BYTES = 0 if variant == "none" else 16 << 20
                disk_mod.DiskEntryReader.read_ahead = VARIANTS.get(variant, shipped)
                for mode in ("prefix", "fuse"):
                    prompt.run("disk", mode, policy)  # warm-up
                    rows = []
                    for _ in range(5):
                        st = prompt.run("disk", mode, policy)
                        lp = passes[-1]
                        rows.append({"ttft": st.total_s * 1e3, "load": st.load_s * 1e3, "wait": st.load_wait_s * 1e3,
                                     "hidden": st.load_hidden,
                                     "waits": [round(x.elapsed_time(y), 3) for x, y in lp._waits],
                                     "reads": sorted(lp.reads_at.items())})
                    med = sorted(rows, key=lambda r: r["ttft"])[2]
                    print(f"{mode}-{variant} ttft {[round(r['ttft'], 2) for r in rows]} "
                          f"hidden {[round(r['hidden'], 3) for r in rows]} load {[round(r['load'], 1) for r in rows]} "
                          f"wait {[round(r['wait'], 2) for r in rows]}\n  median pass waits per layer {med['waits']}",
                          flush=True)
                    out.setdefault(f"{mode}-{variant}", []).extend(rows)
    Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
