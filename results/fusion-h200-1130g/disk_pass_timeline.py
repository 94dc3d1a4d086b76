"""How disk-pass-timeline.log was measured (GPU): where a disk-bound fused pass's TTFT beyond its reads goes.

For reuse and fuse@15% from the disk tier (random-weight shape, 6 x 512 stored tokens + 32, page cache dropped),
four passes each: the host time from the pass's start to its loader's start, to the first read, the reads' span
and union, from the last read to the loader's exit (the last layer's copy and compute, the logits, the sync) and
from there to the pass's return.

Usage: python3 results/fusion-h200-1130g/disk_pass_timeline.py mistral-7b
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import ragfuse.engine.model_runner as model_runner
from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy, prefetch
from ragfuse.engine.fusion.prefetch import _covered
from ragfuse.engine.kvstore import DiskTier

MARKS: dict = {}
_fuse, _enter, _exit = model_runner.fuse_prefill, prefetch.LayerPrefetcher.__enter__, prefetch.LayerPrefetcher.__exit__


def _timed_fuse(*args, **kwargs):
    MARKS["start"] = time.perf_counter()
    out = _fuse(*args, **kwargs)
    MARKS["end"] = time.perf_counter()
    return out


def _timed_enter(self):
    MARKS["enter"] = time.perf_counter()
    return _enter(self)


def _timed_exit(self, *exc):
    MARKS["loader"], MARKS["exit"] = self, time.perf_counter()
    return _exit(self, *exc)


model_runner.fuse_prefill = _timed_fuse
prefetch.LayerPrefetcher.__enter__ = _timed_enter
prefetch.LayerPrefetcher.__exit__ = _timed_exit


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main() -> None:
    args = argparse.Namespace(chunks=6, chunk_tokens=512, query_tokens=32, device="cuda", model=None)
    eng = _engine(args, sys.argv[1])
    chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
    prompt = StoredPrompt(eng, chunks, query)
    with tempfile.TemporaryDirectory() as tmp:
        prompt.keep_in(DiskTier(Path(tmp) / "kv", prompt.kv_bytes * 2, reserve_bytes=0))
        for mode, ratio in (("reuse", 0.0), ("fuse", 0.15)):
            policy = SelectionPolicy.default().with_ratio(ratio)
            prompt.run("disk", mode, policy)
            for _ in range(4):
                st = prompt.run("disk", mode, policy)
                spans = sorted(MARKS["loader"]._read_spans)
                print(mode, "ttft", ms(st.total_s), "setup->enter", ms(MARKS["enter"] - MARKS["start"]),
                      "enter->first read", ms(spans[0][0] - MARKS["enter"]),
                      "reads first..last", ms(spans[-1][1] - spans[0][0]), "union", ms(_covered(spans)),
                      "last read end->loader exit", ms(MARKS["exit"] - max(end for _, end in spans)),
                      "exit->end", ms(MARKS["end"] - MARKS["exit"]), "last read len", ms(spans[-1][1] - spans[-1][0]),
                      "compute", ms(st.compute_s), "wait", ms(st.load_wait_s), flush=True)


if __name__ == "__main__":
    main()
