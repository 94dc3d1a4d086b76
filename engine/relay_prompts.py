"""System prompts registered on demand (a server's chat requests, the RAG pipeline's instructions),
kept to a bound with least-recently-used release.

``LLMEngine.register_system`` is the primitive: an application registers its prompt once and
releases it when done. Callers that see system prompts arrive with their requests instead (an
OpenAI-style chat carries its system message every time) cannot know when one is done, so this
registry does the bookkeeping: the same prompt text is registered once and reused by every request
that carries it; when ``max_prompts`` are registered, the least recently used prompt that no
unfinished request follows is released to make room. When every registered prompt is in use the
request is served without relay (``acquire`` returns None): same output, only slower.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


class RelayPrompts:
    def __init__(self, engine: LLMEngine, max_prompts: int) -> None:
        self.engine = engine
        self.max_prompts = min(max_prompts, engine.systems.capacity)
        # ids this registry handed out (least recent first), with their tokens
        self._used: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.releases = 0  # prompts released to make room
        self.reuses = 0  # requests that found their prompt registered already

    @property
    def registered(self) -> int:
        """Prompts this registry holds registered (read-only: a metrics thread may ask)."""
        return sum(self.engine.systems.find(list(toks)) == sid for sid, toks in list(self._used.items()))

    def _prune(self) -> None:
        """Forget ids released behind this registry's back (``release_system`` called directly)."""
        for sid, toks in list(self._used.items()):
            if self.engine.systems.find(list(toks)) != sid:
                del self._used[sid]

    def acquire(self, token_ids: list[int]) -> int | None:
        """The id of the registered prompt with these tokens (registering it if needed), or None
        when the bound is reached and every registered prompt has unfinished requests."""
        known = self.engine.systems.find(token_ids)
        if known is not None:
            self.reuses += 1
        else:
            if not self._make_room():
                return None
            known = self.engine.register_system(token_ids)
        self._used[known] = tuple(token_ids)
        self._used.move_to_end(known)
        return known

    def release_idle(self) -> int:
        """Release every prompt this registry holds that no unfinished request follows (a front end
        closing: its registrations end with it); returns how many."""
        self._prune()
        idle = [sid for sid in self._used if not self.engine.system_busy(sid)]
        for sid in idle:
            self.engine.release_system(sid)
            del self._used[sid]
        return len(idle)

    def _make_room(self) -> bool:
        """Release idle prompts until one more fits (under both this bound and the engine's)."""
        def full() -> bool:
            return len(self._used) >= self.max_prompts or self.engine.systems.free_count == 0

        self._prune()
        while full():
            idle = next((sid for sid in self._used if not self.engine.system_busy(sid)), None)
            if idle is None:
                return False
            self.engine.release_system(idle)
            del self._used[idle]
            self.releases += 1
        return True
