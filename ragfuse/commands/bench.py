"""``ragfuse bench NAME``: benchmarks; each lives in ``ragfuse.bench.<name>`` with ``register``."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable

BENCHES = ["engine", "store", "fusion", "vllm", "relay", "tree", "sessions", "server", "server_reuse"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (results.json, results.md and a PNG in --out)")
    bsub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    for name in BENCHES:
        importlib.import_module(f"ragfuse.bench.{name}").register(bsub)
    for parser in dict.fromkeys(bsub.choices.values()):
        run = parser.get_default("func")
        if run is not None:
            parser.set_defaults(func=_checked(run))


def _checked(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` after the checks every benchmark needs before it spends minutes measuring: ``--device
    cuda`` on a machine without CUDA (the server benchmarks would otherwise start a server process
    that loads the model and dies, its log pasted into the error) and an ``--out`` that is a file or
    cannot be written (found by the report writer only once the results were ready). Ctrl-C after
    some rows finished (``BenchInterrupted``: they were written, marked) is one line on stderr and
    exit status 130, as ``ragfuse eval qa``'s; before any, the line says nothing was written."""

    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        from ragfuse.bench.partial import BenchInterrupted
        from ragfuse.bench.report import prepare_out_dir
        from ragfuse.engine.errors import RagfuseError

        if getattr(args, "device", None) == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RagfuseError("--device cuda: no CUDA device here")
        if getattr(args, "out", None):
            prepare_out_dir(args.out)
        try:
            return run(args)
        except BenchInterrupted as exc:
            print(f"ragfuse: bench {args.bench}: {exc}", file=sys.stderr, flush=True)
            return 130

    return checked
