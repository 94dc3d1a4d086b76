"""``ragfuse bench NAME``: benchmarks; each lives in ``ragfuse.bench.<name>`` with ``register``."""

from __future__ import annotations

import argparse
import importlib

BENCHES = ["engine", "store", "fusion", "vllm", "relay", "tree", "sessions", "server", "server_reuse"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (results.json, results.md and a PNG in --out)")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    for name in BENCHES:
        importlib.import_module(f"ragfuse.bench.{name}").register(bsub)
