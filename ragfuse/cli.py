"""``ragfuse`` command line: one subcommand per module in ``ragfuse.commands``.

Every user error (unknown model, missing file, bad argument) is one line on stderr and exit code
2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module in ragfuse.commands that defines ``register(subparsers)``
COMMANDS = {
    "generate": "generate",
    "bench": "bench",
    "ingest": "ingest",
    "search": "search",
    "store": "store",
    "profile": "profile",
    "ask": "ask",
    "eval": "eval",
    "serve": "serve",
    "demo": "demo",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"ragfuse: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ragfuse", description="RAG middleware with a KV-cache fusion engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(f"ragfuse.commands.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from ragfuse.engine.errors import RagfuseError

    try:
        return int(args.func(args) or 0)
    except RagfuseError as exc:
        sys.stderr.write(f"ragfuse: error: {exc}\n")
        return 2
    except FileNotFoundError as exc:
        sys.stderr.write(f"ragfuse: error: no such file: {exc.filename or exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("ragfuse: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
