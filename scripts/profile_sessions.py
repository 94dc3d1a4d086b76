"""Profile a session turn on a CUDA device: where a turn's time goes beyond its forward.

Usage: python3 scripts/profile_sessions.py OUT_DIR [--history 1024,4096,16384] [--sweep] [--matmuls-only]
Random weights of the bench's shape and engine (``ragfuse bench sessions``: mistral-7b, context for a
28K history), one 256-token turn (+1 answer token) per history. Prints and writes OUT_DIR/profile.txt:
medians of the turn as the bench times it (history copied at the turn's start, or all on the GPU
before it: the floor) and of its parts (the forward alone, one graph or one per layer, with and
without the history writes), per-kernel GPU time of a profiled turn, and with ``--sweep`` the turn's
attention kernel alone under other tilings; gzipped Chrome traces of the 4K turns go beside it.
``--matmuls-only``: just the layer's four matmuls at row counts around a 257-token turn (its prefill
graph pads the rows to a bucket, and cuBLAS picks its tiles by the row count).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ragfuse.bench.sessions import _ttft_engine, int_list, open_session
from ragfuse.engine import SamplingParams
from ragfuse.engine.sessions import SessionStore
from ragfuse.engine.sessions.prefix import HistoryWriter

LINES: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    LINES.append(text)


def median_ms(fn: Callable[[], float], reps: int) -> float:
    fn()
    fn()
    return statistics.median(fn() for _ in range(reps)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--history", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-after-s", type=float, default=110.0, help="skip the sweep when this late")
    p.add_argument("--matmuls-only", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.matmuls_only:
        matmuls()
        (out / "matmuls.txt").write_text("\n".join(LINES) + "\n")
        return
    start = time.perf_counter()
    eng, shape = _ttft_engine(argparse.Namespace(shape=None, device="cuda", new_tokens=a.new_tokens), 28672)
    say(f"engine {shape} ready in {time.perf_counter() - start:.1f} s")
    gen = torch.Generator().manual_seed(0)
    for hist in a.history:
        history = torch.randint(3, eng.model_config.vocab_size, (hist,), generator=gen).tolist()
        new = torch.randint(3, eng.model_config.vocab_size, (a.new_tokens,), generator=gen).tolist()
        profile_history(eng, history, new, a.reps, out)
    (out / "profile.txt").write_text("\n".join(LINES) + "\n")
    if a.sweep and time.perf_counter() - start < a.sweep_after_s:
        sweep(a.new_tokens + 1, [4096, 16384])
    (out / "profile.txt").write_text("\n".join(LINES) + "\n")
    say(f"done in {time.perf_counter() - start:.1f} s")


def profile_history(eng: Any, history: list[int], new: list[int], reps: int, out: Path) -> None:
    """Time (and at 4K profile) one turn of ``new`` tokens after ``history``, and its parts."""
    sync = torch.cuda.synchronize
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    runner, cache = eng.runner, eng.runner.kv_cache
    hist = len(history)
    store = SessionStore(None, eng.fingerprint, eng.dtype, cpu_bytes=64 << 30, disk_bytes=64 << 30)
    sid = f"s{hist}"
    conversation = open_session(eng, store, sid, history, new)
    fed = conversation[hist:]

    def turn(mode: str) -> float:
        """TTFT of a turn: ``copy`` = copied from host memory at its start (the bench's cpu row),
        ``all-first`` = every layer's copy queued before it starts (the old way), ``floor`` = all of
        it on the GPU before the turn (that copy not timed)."""
        sync()
        t0 = time.perf_counter()
        planned = eng.begin_session_turn(sid, conversation, 1, new_tokens=len(fed))
        t1 = time.perf_counter()
        if mode == "floor":
            eng.preload_session_turn(planned)
            sync()
        elif mode == "all-first":
            eng.preload_session_turn(planned)
        t2 = time.perf_counter()
        rid = eng.start_session_turn(planned, one)
        sync()
        took = time.perf_counter() - t2 + t1 - t0
        eng.abort(rid)
        return took

    def plan() -> float:
        t0 = time.perf_counter()
        eng.begin_session_turn(sid, conversation, 1, new_tokens=len(fed)).close()
        return time.perf_counter() - t0

    def forward(n: int, how: str) -> float:
        """The forward of ``n`` new tokens after ``hist`` cached ones, plus the first token's logits:
        ``graph`` one graph, ``layers`` one graph per layer, ``writer`` per layer with the history
        (already on the GPU) written in between, ``writes`` the history writes alone."""
        planned = eng.begin_session_turn(sid, conversation, 1, new_tokens=len(fed))
        eng.preload_session_turn(planned)
        with eng.borrowed_blocks([[0] * (hist + n)]) as (table,), torch.inference_mode():
            writer = HistoryWriter(planned.source, cache, table, runner.model.model.rotary, eng._write_stream)
            sync()
            t = time.perf_counter()
            if how == "writes":
                for i in range(eng.model_config.num_layers):
                    writer(i)
            else:
                before = {"graph": None, "layers": lambda i: None, "writer": writer}[how]
                hidden = runner.forward_continuation(fed[:n], hist, table, before_layer=before)
                runner.model.compute_logits(hidden[-1:])
            sync()
            took = time.perf_counter() - t
        planned.close()
        return took

    r = reps
    say(f"\n== history {hist}, {len(fed)} fed tokens")
    say(f"  plan (session lookup + plan)       {median_ms(plan, r):7.2f} ms")
    for mode in ("copy", "all-first", "floor"):
        say(f"  turn {mode:10s} (TTFT, plan incl.)  {median_ms(lambda m=mode: turn(m), r):7.2f} ms")
    for n, how in ((256, "graph"), (len(fed), "graph"), (288, "graph"), (len(fed), "layers"),
                   (len(fed), "writer"), (len(fed), "writes")):
        say(f"  forward n={n:4d} {how:7s}                {median_ms(lambda n=n, h=how: forward(n, h), r):7.2f} ms")
    if hist == 4096:
        for mode in ("floor", "copy"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                took = turn(mode)
            ka = prof.key_averages()
            gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
            say(f"\n-- profiled turn {mode} at {hist}: wall {took * 1e3:.2f} ms, GPU time {gpu_us / 1e3:.2f} ms")
            say(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
            say(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
            trace = out / f"trace-{mode}-{hist}.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
    store.close()
    eng.sessions = None


def sweep(t: int, contexts: list[int]) -> None:
    """The turn's attention alone (``t`` queries in a graph of the next bucket's rows, as the layer
    graphs run it) under other tilings and split counts."""
    from ragfuse.engine.cuda_graphs import prefill_bucket
    from ragfuse.kernels import paged_attention_triton as pat

    rows = prefill_bucket(t) or t
    say(f"\n== attention of {t} queries (grid of {rows} rows), one layer, graph replays (ms)")
    for ctx in contexts:
        sweep_context(pat, ctx, t, rows)


VARIANTS: list[tuple[tuple[int, int, int, int], int | None]] = [
    ((64, 64, 4, 3), None), ((64, 64, 4, 2), None), ((32, 64, 4, 3), None), ((64, 64, 8, 3), None),
]


def sweep_context(pat: Any, ctx: int, t: int, rows: int) -> None:
    import triton.testing

    from ragfuse.bench.kernel_timing import D, turn_inputs

    k_cache, v_cache, tables, q, lens, cu, flops = turn_inputs(t, ctx, rows)
    default = pat._prefill_tiles
    for tiles, splits in VARIANTS:
        pat._prefill_tiles = lambda d, dev, pack=False, tiles=tiles: tiles

        def call(splits: int | None = splits) -> object:
            return pat.paged_prefill_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5, None, rows,
                                                      max_seq_len=32768, num_splits=splits)
        try:
            ms = float(triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median"))
            say(f"  ctx {ctx:6d} tiles {tiles} splits {splits}: {ms:.4f} ms ({flops / ms / 1e9:.0f} TF/s)")
        except Exception as e:  # a tiling that does not fit: note it, go on
            say(f"  ctx {ctx:6d} tiles {tiles} splits {splits}: failed {e!r:.150}")
    pat._prefill_tiles = default


def matmuls(rows: tuple[int, ...] = (256, 257, 272, 288, 320, 384)) -> None:
    """A Mistral-7B layer's matmuls (qkv, o, gate|up, down) at each row count, graph replays."""
    import triton.testing

    from ragfuse.bench.shapes import shape_config

    c = shape_config("mistral-7b")
    h, kv, inter = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    shapes = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) for k, (n, kk) in shapes.items()}
    say("\n== one layer's matmuls by row count (ms per layer, graph replays)")
    for m in rows:
        parts = {}
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            parts[name] = float(triton.testing.do_bench_cudagraph(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), rep=30, return_mode="median"))
        say(f"  rows {m:4d}: total {sum(parts.values()):.4f}  " + "  ".join(f"{k} {v:.4f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
