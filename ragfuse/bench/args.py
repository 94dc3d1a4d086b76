"""argparse types the benchmarks share.

A count of zero, an empty list or an unknown name is refused while the arguments are parsed, as a
one-line usage error: found later it would surface as a traceback from deep inside a measurement
(a median of no runs, a division by zero chunks) after the model had loaded and minutes had passed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from ragfuse.commands.generate import positive_int, unit_ratio

__all__ = ["choice_list", "int_list", "positive_float", "positive_int", "ratio_list"]


def positive_float(value: str) -> float:
    """A finite number above zero (a duration, a rate): NaN passes every ``<= 0`` check unnoticed."""
    try:
        x = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from exc
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {value}")
    return x


def _items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
    return items


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers; ``4K`` is 4096."""
    values = []
    for item in _items(text):
        kilo = item.lower().endswith("k")
        try:
            n = int(item[:-1] if kilo else item) * (1024 if kilo else 1)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
        if n < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers, got {n}")
        values.append(n)
    return values


def ratio_list(text: str) -> list[float]:
    """Comma-separated ratios, each in [0, 1]."""
    return [unit_ratio(item) for item in _items(text)]


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of names, each one of ``choices``, at least one."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = _items(text)
        unknown = [x for x in items if x not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (choose from {', '.join(allowed)})")
        return items

    return parse
