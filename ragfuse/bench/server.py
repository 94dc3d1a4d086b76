"""``ragfuse bench server``: a bounded load test of ``ragfuse serve``.

Starts the server in its own process (``ragfuse serve`` on a free loopback port, an empty store in
a temporary directory unless ``--store``), then ``--clients`` concurrent clients each stream chat
completions back to back for ``--seconds``. Reported: errors, requests/s, time to first token
(p50/p95, as the client sees it), generated tokens/s, and the server's resident memory at the start
and end of the load with its trend over the run (flat memory: no leak per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .args import positive_float, positive_int
from .partial import Report
from .report import machine_info
from .serve_process import served

TOPICS = ["rivers", "volcanoes", "bread", "bicycles", "owls", "glass", "tides", "chess", "copper", "maps",
          "tea", "clocks", "bees", "comets", "salt", "violins"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="load test of `ragfuse serve`: N streaming clients for T seconds")
    p.add_argument("--clients", type=positive_int, default=32, help="concurrent clients streaming chat completions")
    p.add_argument("--seconds", type=positive_float, default=60.0, help="length of the load in seconds")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per answer")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model the server loads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the server runs the model (auto: CUDA when available, else CPU)")
    p.add_argument("--store", help="store to serve (default: an empty one in a temporary directory)")
    p.add_argument("--out", default="bench-results/server", help="output folder (default bench-results/server)")
    p.set_defaults(func=run)


@dataclass
class Load:
    ttft: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the load, MiB)


def run(args: argparse.Namespace) -> int:
    key = secrets.token_hex(16)
    load = Load()
    part = f"the {args.seconds:g} s load"
    report = Report(args.out, "ragfuse bench server", {"machine": machine_info(args.device)}, [part],
                    plot=lambda fig: _plot(fig, load, args))
    with report.interruptible():
        report.begin(part)
        try:
            with tempfile.TemporaryDirectory(prefix="ragfuse-bench-server-") as tmp:
                serve_args = ["--store", args.store or str(Path(tmp) / "store"), "--model", args.model, "--device",
                              args.device, "--no-gate", "--max-tokens", str(args.max_tokens), "--log-level", "warning"]
                with served(serve_args, key, Path(tmp)) as server:
                    asyncio.run(_drive(server.url, key, server.process.pid, args, load))
        except KeyboardInterrupt:  # the requests of the load finished so far, if any, summed up as a whole load's
            if load.rss and load.done_at:  # (load.rss: past the warm-up, whose request is not counted)
                _summarize(args, load, report)
            raise
    _summarize(args, load, report)
    path = report.write()
    row = report.rows[0]
    print(f"{row['requests']} requests, {row['errors']} errors, {row['requests_per_s']:.2f} req/s, "
          f"{row['tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s, "
          f"RSS {row['rss_start_mib']:.0f} -> {row['rss_end_mib']:.0f} MiB -> {path}")
    return 0


async def _drive(url: str, key: str, pid: int, args: argparse.Namespace, load: Load) -> None:
    """The load, its measures gathered in ``load`` as they come (a Ctrl-C keeps those)."""
    import httpx
    import psutil

    proc = psutil.Process(pid)
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300,
                                 limits=limits) as http:
        await _one(http, 0, args, load, time.perf_counter())  # warm-up (not counted)
        load.ttft.clear()
        load.done_at.clear()
        load.tokens = 0
        t0 = time.perf_counter()
        end = t0 + args.seconds
        load.rss.append((0.0, proc.memory_info().rss / 2**20))

        async def client(i: int) -> None:
            n = 0
            while time.perf_counter() < end:
                await _one(http, i * 1000 + n, args, load, t0)
                n += 1

        async def sample(bar: tqdm) -> None:
            while time.perf_counter() < end:
                await asyncio.sleep(1.0)
                load.rss.append((time.perf_counter() - t0, proc.memory_info().rss / 2**20))
                bar.n = min(int(time.perf_counter() - t0), int(args.seconds))
                bar.set_postfix(requests=len(load.done_at), errors=len(load.errors), refresh=False)
                bar.refresh()

        with tqdm(total=int(args.seconds), desc=f"bench server ({args.clients} clients)", unit="s") as bar:
            await asyncio.gather(sample(bar), *(client(i) for i in range(args.clients)))
        load.rss.append((time.perf_counter() - t0, proc.memory_info().rss / 2**20))


async def _one(http: Any, n: int, args: argparse.Namespace, load: Load, t0: float) -> None:
    """One streaming chat completion; its TTFT (first content chunk) and tokens go into ``load``."""
    body = {"model": args.model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0.7, "seed": n,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell me something about {TOPICS[n % len(TOPICS)]}."}]}
    start = time.perf_counter()
    first: float | None = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                load.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    load.errors.append(event["error"]["message"])
                    return
                if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
                if event.get("usage"):
                    load.tokens += event["usage"]["completion_tokens"]
    except Exception as exc:  # a refused or broken connection is an error of the server under test
        load.errors.append(f"{type(exc).__name__}: {exc}")
        return
    load.ttft.append((first or time.perf_counter()) - start)
    load.done_at.append(time.perf_counter() - t0)


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else (xs or [0.0])[0]


def _summarize(args: argparse.Namespace, load: Load, report: Report) -> None:
    """The load's row, notes and samples into ``report``: from its requests finished so far."""
    n = len(load.done_at)
    # the load's length, with the requests in flight at its end let finish (or the last finished before a Ctrl-C)
    elapsed = max(load.rss[-1][0], *load.done_at[-1:])
    rss0, rss1 = load.rss[0][1], load.rss[-1][1]
    half = [m for t, m in load.rss if t >= args.seconds / 2]
    report.rows.append({
        "clients": args.clients, "seconds": round(elapsed, 1), "max_tokens": args.max_tokens, "requests": n,
        "errors": len(load.errors), "requests_per_s": n / elapsed, "tokens_per_s": load.tokens / elapsed,
        "ttft_p50_s": _pct(load.ttft, 50), "ttft_p95_s": _pct(load.ttft, 95),
        "rss_start_mib": rss0, "rss_end_mib": rss1, "rss_max_mib": max(m for _, m in load.rss),
        "rss_growth_second_half_mib": (half[-1] - half[0]) if len(half) > 1 else 0.0,
    })
    notes = (f"{args.clients} concurrent streaming clients for {args.seconds:.0f} s against `ragfuse serve` "
             f"({args.model}, {args.device}), {args.max_tokens} tokens per answer, temperature 0.7. TTFT is "
             "what a client sees (request sent to first content chunk), queueing included. RSS is the server "
             "process's, sampled every second after a warm-up request.")
    if load.errors:
        notes += f"\n\nFirst errors: {load.errors[:3]}"
    report.notes = notes
    report.results.update(ttft_s=load.ttft, rss_mib=load.rss, errors_seen=load.errors[:20])


def _plot(fig: Any, load: Load, args: argparse.Namespace) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    ts, mib = zip(*load.rss)
    ax1.plot(ts, mib, marker=".")
    ax1.set(xlabel="seconds into the load", ylabel="server RSS (MiB)", title="memory under load")
    ax1.set_ylim(0, max(mib) * 1.2)
    done = sorted(load.done_at)
    ax2.plot(done, range(1, len(done) + 1))
    ax2.set(xlabel="seconds into the load", ylabel="requests completed",
            title=f"{args.clients} streaming clients, {len(load.errors)} errors")
