"""Multi-turn sessions (AttentionStore): each conversation's KV kept across turns in host memory and
on disk, saved in the background, loaded layer by layer while the new turn is prefilled, truncated
directly on the position-free stored KV, and placed with the scheduler's look-ahead."""

from .history import TurnPlan, plan_turn, surely_fed
from .placement import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LRUPolicy,
    Move,
    PlacementStats,
    SchedulerAwarePolicy,
    SessionInfo,
    SessionPlacement,
    make_policy,
)
from .snapshot import Snapshot, take_snapshot
from .source import SessionCorruptError, SessionSource
from .store import SESSION_ID_PATTERN, SessionRecord, SessionStore, SessionSummary, TurnTicket, check_session_id
from .turn import SessionTurn, begin_turn

__all__ = [
    "POLICIES", "SESSION_ID_PATTERN", "EvictionPolicy", "FIFOPolicy", "LRUPolicy", "Move", "PlacementStats",
    "SchedulerAwarePolicy", "SessionCorruptError", "SessionInfo", "SessionPlacement", "SessionRecord",
    "SessionSource", "SessionStore", "SessionSummary", "SessionTurn", "Snapshot", "TurnPlan", "TurnTicket",
    "begin_turn", "check_session_id", "make_policy", "plan_turn", "surely_fed", "take_snapshot",
]
