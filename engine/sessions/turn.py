"""One turn of a session: the plan (what is fed, what comes from storage), its source and its stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..fusion import FusionStats, Segment
from .history import TurnPlan, plan_turn
from .source import SessionCorruptError, SessionSource
from .store import SessionStore, TurnTicket


@dataclass
class SessionTurn:
    session_id: str
    plan: TurnPlan
    source: SessionSource | None
    tier: str | None  # where the reused KV came from ("cpu", "disk"), None: recomputed
    new_tokens: int
    keep_first: int
    ticket: TurnTicket  # the store's hold on the running turn (a deletion meanwhile drops its save)
    notes: list[str] = field(default_factory=list)
    fusion: FusionStats | None = None

    @property
    def reused(self) -> int:
        return self.plan.reused if self.source is not None else 0

    def segments(self, tail: list[Segment] | None = None) -> list[Segment]:
        """The fed tokens as fusor segments: the stored history (rows re-rotated to their new
        positions), then the rest; with ``tail`` (e.g. a RAG prompt's segments, which must be the
        last fed tokens) the rest is the uncached history gap followed by ``tail``."""
        ids = self.plan.token_ids
        segs: list[Segment] = []
        if self.reused:
            segs.append(Segment(ids[: self.reused], self.source, "session history"))
        end = len(ids) - sum(len(s.token_ids) for s in tail) if tail is not None else len(ids)
        if end > self.reused:
            segs.append(Segment(ids[self.reused : end], None, "new turn" if tail is None else "history"))
        return segs + (tail or [])

    def stats(self, prompt_tokens: int) -> dict[str, Any]:
        f = self.fusion
        return {
            "session_id": self.session_id,
            "session_tokens_reused": self.reused,
            "session_tier": self.tier,
            "prefilled_tokens": prompt_tokens - self.reused,
            "session_truncated_tokens": self.plan.truncated,
            "session_load_s": f.load_s if f is not None and self.reused else 0.0,
            "session_load_hidden": f.load_hidden if f is not None and self.reused else None,
            "session_notes": list(self.notes),
        }

    def close(self) -> None:
        if self.source is not None:
            self.source.finish()


def begin_turn(
    store: SessionStore, session_id: str, conversation: list[int], max_len: int, reserve: int, new_tokens: int,
    keep_first: int, use_stored: bool = True,
) -> SessionTurn:
    """Look the session up and plan the turn; a session that cannot be used (lost, or its file on
    disk unreadable: truncated, damaged header) is dropped and recomputed, with a note saying why."""
    notes: list[str] = []
    look = store.lookup(session_id) if use_stored else None
    rec = look.record if look is not None else None
    if look is not None and look.reason:
        # a caller that keeps no transcript (a RAG session) read its history from the record, now gone
        notes.append(f"{look.reason}: " + ("history recomputed" if len(conversation) > new_tokens
                                           else "its history is lost, the conversation starts afresh"))
    elif look is not None and rec is None and len(conversation) > new_tokens + keep_first:
        # a history the store never had, or no longer has without a trace (sessions kept in memory
        # only, then a restart): said, so a turn that costs a full prefill does not look like a hit
        notes.append(f"session {session_id} has no stored KV here (new to this store, deleted, or not kept across a "
                     "restart): history computed")
    plan = plan_turn(conversation, rec.tokens if rec else None, rec.ranges if rec else None, max_len, reserve,
                     new_tokens, keep_first)
    source = None
    if look is not None and look.open_source is not None and plan.reused:
        try:
            source = look.open_source(plan.reused, plan.rows)
        except SessionCorruptError as exc:
            store.drop(session_id, exc.why)
            notes.append(f"{exc}: history recomputed")
            plan = plan_turn(conversation, None, None, max_len, reserve, new_tokens, keep_first)
    if plan.rows is not None:
        how = "stored KV cut directly (positions re-applied)" if source is not None else "tokens cut, recomputed"
        notes.append(f"context overflow: {plan.truncated} oldest tokens cut ({how})")
    return SessionTurn(session_id, plan, source, look.tier if source is not None and look else None,
                       new_tokens, keep_first, store.begin(session_id, conversation), notes)
