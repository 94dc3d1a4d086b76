"""A benchmark's report that survives Ctrl-C: the rows finished so far are written, marked as such.

A benchmark runs for minutes to hours; a user who stops it should keep what it measured, as
``ragfuse eval qa`` keeps its finished cases. Every benchmark builds one ``Report``, appends each row
to ``report.rows`` as soon as it is measured, names each part as it starts (``begin``), and runs its
measuring inside ``report.interruptible()``. On Ctrl-C there the finished rows are written with
``write_report``, the results marked ``"interrupted"`` with what finished and what did not, and
``BenchInterrupted`` raised; ``ragfuse bench`` turns it into one line on stderr and exit status 130.
Without a finished row nothing is written, and ``BenchInterrupted`` says so (exit status 130 too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .report import write_report


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C in a benchmark after its finished rows were written; the message says what finished
    and where the files are. A KeyboardInterrupt still, so whoever handles Ctrl-C stops as for one."""


class Report:
    """What a benchmark writes, filled in as it runs: ``results`` (the settings and figures of the
    whole run), ``rows`` (the table, one row per finished measurement), ``plot`` and ``notes`` (text,
    or a function that makes it from what is there when the report is written, whole or not).

    ``parts`` names the benchmark's parts in the order they run, for the interrupted mark."""

    def __init__(
        self,
        out: str | Path,
        title: str,
        results: dict[str, Any],
        parts: Sequence[str],
        plot: Callable[[Any], None] | None = None,
        notes: str | Callable[[], str] = "",
    ) -> None:
        self.out, self.title, self.results = out, title, results
        self.rows: list[dict[str, Any]] = []
        self.parts = list(parts)
        self.plot, self.notes = plot, notes
        self.part: str | None = None
        self.finished: list[str] = []

    def begin(self, part: str) -> None:
        """``part`` starts: the one before it (if any) has finished."""
        if self.part is not None:
            self.finished.append(self.part)
        self.part = part

    def write(self) -> Path:
        """Write the report as it stands (``write_report``); returns its folder."""
        notes = self.notes() if callable(self.notes) else self.notes
        return write_report(self.out, self.title, self.results, self.rows, self.plot, notes)

    def interrupted_mark(self) -> str:
        """What finished and what did not, in words, for the results of a run stopped now."""
        n = len(self.rows)
        not_finished = ([f"{self.part} (started)"] if self.part else []) + [
            p for p in self.parts if p not in self.finished and p != self.part]
        return (f"stopped by the user {f'during {self.part} ' if self.part else ''}after {n} row{'s' * (n != 1)}; "
                f"finished: {', '.join(self.finished) or 'nothing'}; "
                f"not finished: {', '.join(not_finished) or 'nothing'}")

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Run the block; on Ctrl-C in it, write the finished rows marked interrupted and raise
        ``BenchInterrupted`` (none finished: nothing written, and its message says so)."""
        try:
            yield
        except KeyboardInterrupt:
            _close_progress_bars()
            if not self.rows:
                where = f" (during {self.part})" if self.part else ""
                raise BenchInterrupted(f"stopped by the user before any row finished{where}: nothing written") from None
            self.results["interrupted"] = self.interrupted_mark()
            path = self.write()
            raise BenchInterrupted(f"{self.results['interrupted']}; the finished rows are in {path}") from None


def _close_progress_bars() -> None:
    """End the lines of the progress bars a Ctrl-C left open (the loops it stopped still hold them,
    until their frames are collected), so that the message after them starts a line of its own. tqdm
    keeps its open bars in ``_instances``, which its own ``external_write_mode`` reads the same way."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
