"""``ragfuse`` command line: one subcommand per module in ``ragfuse.commands``.

Every user error (unknown model, missing file, bad argument) is one line on stderr and exit code
2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from ragfuse import __version__

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
    "session": "session",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if self._subparsers is not None and "required" in message:  # a command (group) named alone
            choices = self._subparsers._group_actions[0].choices or {}
            message = f"name a command: {', '.join(choices)}"
            sys.stderr.write(self.format_usage())
        sys.stderr.write(f"ragfuse: error: {message}\n")
        raise SystemExit(2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or only ``command``'s when it is one: running a command
    then imports nothing of the others (the benchmarks load torch just to declare their options)."""
    parser = _Parser(prog="ragfuse", description="RAG middleware with a KV-cache fusion engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    parser.add_argument("--version", action="version", version=f"ragfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module in modules:
        importlib.import_module(f"ragfuse.commands.{module}").register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: by default it killed the process at
    once, so the cleanup Ctrl-C gets (an ingest's store closed, its KV files finished or removed)
    never ran and the user got no word."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def _terminate_like_ctrl_c() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` while a command runs (main thread only, where signals can be
    handled), the previous handler back afterwards (``main`` is also called in-process, by tests)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the only global option takes no value
    args = build_parser(command).parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from ragfuse.engine.errors import RagfuseError

    try:
        with _terminate_like_ctrl_c():
            return int(args.func(args) or 0)
    except Terminated:
        sys.stderr.write("ragfuse: terminated (SIGTERM)\n")
        return 128 + signal.SIGTERM
    except RagfuseError as exc:
        sys.stderr.write(f"ragfuse: error: {exc}\n")
        return 2
    except FileNotFoundError as exc:
        sys.stderr.write(f"ragfuse: error: no such file: {exc.filename or exc}\n")
        return 2
    except OSError as exc:  # a read-only store, no permission, a full disk: said in a line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        why = exc.strerror or str(exc)
        hint = (" (ragfuse writes its locks, KV entries and session records into the store and sessions folders)"
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "")
        sys.stderr.write(f"ragfuse: error: {why}{where}{hint}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("ragfuse: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
