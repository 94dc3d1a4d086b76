"""Sessions as the server exposes them (``/v1/sessions``: list, delete), behind a small interface.

ragfuse's own session store (multi-turn KV kept between turns) is being built separately; until it
lands, ``MemorySessions`` records the turns of chats that name a ``session_id``, in memory and
bounded, so the routes work end to end. A real store only needs ``list`` and ``delete`` (and
``record`` if it wants the server to report turns to it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Protocol


@dataclass
class SessionInfo:
    id: str
    turns: int
    created: float
    updated: float

    def as_dict(self) -> dict[str, Any]:
        return {"object": "session", **asdict(self)}


class SessionStore(Protocol):
    def list(self) -> list[SessionInfo]: ...

    def delete(self, session_id: str) -> bool: ...

    def record(self, session_id: str, messages: list[dict[str, str]], answer: str) -> None: ...


class MemorySessions:
    """The last ``max_sessions`` sessions' turns, least recently used dropped first."""

    def __init__(self, max_sessions: int = 1000) -> None:
        self.max_sessions = max_sessions
        self._turns: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._info: dict[str, SessionInfo] = {}
        self._lock = threading.Lock()

    def record(self, session_id: str, messages: list[dict[str, str]], answer: str) -> None:
        now = time.time()
        with self._lock:
            turns = self._turns.pop(session_id, [])
            turns.append({"messages": messages, "answer": answer})
            self._turns[session_id] = turns
            info = self._info.get(session_id) or SessionInfo(session_id, 0, now, now)
            info.turns, info.updated = len(turns), now
            self._info[session_id] = info
            while len(self._turns) > self.max_sessions:
                old, _ = self._turns.popitem(last=False)
                self._info.pop(old, None)

    def list(self) -> list[SessionInfo]:
        with self._lock:
            return [SessionInfo(**asdict(self._info[s])) for s in reversed(self._turns)]

    def delete(self, session_id: str) -> bool:
        with self._lock:
            self._info.pop(session_id, None)
            return self._turns.pop(session_id, None) is not None
