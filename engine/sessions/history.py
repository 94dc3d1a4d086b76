"""Which tokens of a conversation a turn feeds the model, and which of them bring stored KV.

A conversation's *logical* tokens are everything said so far; the tokens *fed* are those the model
attends to, which is fewer once the context window overflowed and the oldest turns were cut. The
fed tokens are kept as ranges of logical indices. Because stored K carries no position, cutting is
done directly on the stored rows: the kept rows are re-rotated to their new, contiguous positions
when loaded, and nothing is recomputed (AttentionStore, section 3.4).

The match between a new prompt and a stored session is by longest common prefix of logical tokens,
so a caller may send the whole conversation each turn (as chat APIs do) and a template that renders
an earlier answer slightly differently from how it was generated only costs the differing tail.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from ..errors import RequestError

Ranges = list[tuple[int, int]]


def common_prefix(a: list[int], b: list[int], chunk: int = 256) -> int:
    """Length of the common prefix: slices compared in C a chunk at a time, then the first differing
    chunk token by token (a Python loop over a 28K-token history costs ~1.5 ms per turn)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + chunk] == b[i : i + chunk]:
        i += chunk
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


def total(ranges: Ranges) -> int:
    return sum(e - s for s, e in ranges)


def clip(ranges: Ranges, end: int) -> Ranges:
    """The parts of ``ranges`` below logical index ``end``."""
    return [(s, min(e, end)) for s, e in ranges if s < end]


def cut(ranges: Ranges, start: int, count: int) -> Ranges:
    """Drop ``count`` fed tokens starting at fed offset ``start`` (offsets count fed tokens only)."""
    out: Ranges = []
    offset = 0
    for s, e in ranges:
        n = e - s
        lo, hi = max(start - offset, 0), min(start + count - offset, n)
        if lo >= hi:
            out.append((s, e))
        else:
            if lo > 0:
                out.append((s, s + lo))
            if hi < n:
                out.append((s + hi, e))
        offset += n
    return out


def kept_rows(before: int, start: int, count: int) -> list[int]:
    """Row indices (of ``before`` stored rows) that survive cutting fed offsets [start, start+count)."""
    return [r for r in range(before) if not start <= r < start + count]


@dataclass
class TurnPlan:
    """What one turn feeds: ``ranges`` of the logical ``conversation``; its first ``reused`` fed
    tokens come from stored rows ``rows`` (None: the first ``reused`` rows as stored)."""

    conversation: list[int]
    ranges: Ranges
    reused: int
    rows: list[int] | None
    truncated: int  # logical tokens not fed (cut now or in an earlier turn) because the context overflowed

    @functools.cached_property
    def token_ids(self) -> list[int]:
        """The fed tokens (made once per turn, from slices of the conversation)."""
        return list(itertools.chain.from_iterable(self.conversation[s:e] for s, e in self.ranges))


def turn_floor(fed: int, new_tokens: int, keep_first: int) -> int:
    """The fewest tokens a turn of ``fed`` tokens can be cut to: its new message (``new_tokens``)
    and the history's first ``keep_first`` (system header, attention sinks), which ``plan_turn``
    never cuts. A caller refuses a turn whose floor plus the room for the answer exceeds the context
    before the engine takes it, and caps a left-out answer length to what the floor leaves."""
    new = min(new_tokens, fed)
    return new + min(keep_first, fed - new)


def plan_turn(
    conversation: list[int],
    stored_tokens: list[int] | None,
    stored_ranges: Ranges | None,
    max_len: int,
    reserve: int,
    new_tokens: int,
    keep_first: int,
    cut_ratio: float = 0.5,
) -> TurnPlan:
    """Plan a turn of ``conversation`` (all logical tokens, this turn's new ones last) over a stored
    session (its logical tokens up to its last stored row, and the ranges its rows cover).

    When the fed tokens plus ``reserve`` (room for the answer) exceed ``max_len``, the oldest fed
    history tokens after the first ``keep_first`` (system prompt, attention sinks) are cut: the
    larger of what is needed and ``cut_ratio`` of them, as serving engines truncate tokens (the RE
    baseline). The turn's last ``new_tokens`` tokens (its new message) are never cut.
    """
    if not conversation:
        raise RequestError("empty prompt")
    ranges: Ranges = [(0, len(conversation))]
    reused = 0
    if stored_tokens is not None and stored_ranges:
        match = min(common_prefix(conversation, stored_tokens), len(conversation) - 1)
        history = clip(stored_ranges, match)
        if history:  # what the stored rows cover, then everything after the last of them
            ranges = history + [(history[-1][1], len(conversation))]
            reused = total(history)
    rows: list[int] | None = None
    fed = total(ranges)
    if fed + reserve > max_len:
        new = min(new_tokens, fed)
        body = fed - turn_floor(fed, new_tokens, keep_first)
        need = fed + reserve - max_len
        if need > body:
            raise RequestError(
                f"the new turn ({new} tokens) with room for {reserve} answer tokens does not fit the "
                f"context of {max_len} even with the whole history cut"
            )
        drop = min(max(need, int(cut_ratio * body)), body)
        rows = kept_rows(reused, keep_first, drop)
        ranges = cut(ranges, keep_first, drop)
        reused = len(rows)
    return TurnPlan(conversation, _merge(ranges), reused, rows, len(conversation) - total(ranges))


def surely_fed(
    history: list[int], stored_ranges: Ranges, prompt: list[int], max_len: int, reserve: int, keep_first: int,
) -> Ranges:
    """The ranges of ``history`` that a turn bringing ``prompt`` (or any shorter prompt) is sure to
    feed, however the history turns out to be fitted to the context: over its stored rows, or
    recomputed whole (rows that fail their checksum), two plans that may cut differently. Empty
    when the prompt does not fit at all.

    A shorter prompt never cuts more: the history's cuttable body is the same, and less overflow
    cuts at most as much of it, oldest first. So a caller may leave out of its prompt text that
    these ranges already hold."""
    conversation = history + prompt
    try:
        plans = [plan_turn(conversation, history, stored_ranges, max_len, reserve, len(prompt), keep_first),
                 plan_turn(conversation, None, None, max_len, reserve, len(prompt), keep_first)]
    except RequestError:
        return []
    fed = [clip(p.ranges, len(history)) for p in plans]
    return [(max(s, t), min(e, u)) for s, e in fed[0] for t, u in fed[1] if max(s, t) < min(e, u)]


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for s, e in ranges:
        if e <= s:
            continue
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def extend(ranges: Ranges, end: int) -> Ranges:
    """``ranges`` with the last one stretched to logical index ``end`` (the answer's tokens)."""
    if not ranges:
        return [(0, end)]
    return ranges[:-1] + [(ranges[-1][0], max(ranges[-1][1], end))]

