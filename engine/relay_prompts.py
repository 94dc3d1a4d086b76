"""System prompts registered on demand (a server's chat requests, the RAG pipeline's instructions),
kept to a bound with least-recently-used release.

``LLMEngine.register_system`` is the primitive: an application registers its prompt once and
releases it when done. Callers that see system prompts arrive with their requests instead (an
OpenAI-style chat carries its system message every time) cannot know when one is done, so this
registry does the bookkeeping: the same prompt text is registered once and reused by every request
that carries it; when ``max_prompts`` are registered, the least recently used prompt that no
unfinished request follows is released to make room. When every registered prompt is in use the
request is served without relay (``acquire`` returns None): same output, only slower. A prompt the
application registered itself is used when the tokens match but never released here: only what
this registry registered is its to release (and what the application registers is handed to it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .system_prompts import SystemPrompt


class RelayPrompts:
    def __init__(self, engine: LLMEngine, max_prompts: int) -> None:
        self.engine = engine
        self.max_prompts = min(max_prompts, engine.systems.capacity)
        # prompts this registry registered itself, by id, least recently used first (the record, not
        # the tokens: an id released behind its back and registered again is someone else's)
        self._used: OrderedDict[int, SystemPrompt] = OrderedDict()
        self.releases = 0  # prompts released to make room
        self.reuses = 0  # requests that found their prompt registered already

    @property
    def registered(self) -> int:
        """Prompts this registry holds registered (read-only: a metrics thread may ask)."""
        return sum(self.engine.systems.find(p.token_ids) == sid for sid, p in list(self._used.items()))

    def _prune(self) -> None:
        """Forget ids released behind this registry's back (``release_system`` called directly)."""
        systems = self.engine.systems
        for sid, prompt in list(self._used.items()):
            if systems.find(prompt.token_ids) != sid or systems.get(sid) is not prompt:
                del self._used[sid]

    def hand_over(self, system_id: int) -> None:
        """The application registered these tokens itself (``register_system``): the prompt is its
        own from now on, never released here."""
        self._used.pop(system_id, None)

    def acquire(self, token_ids: list[int]) -> int | None:
        """The id of the registered prompt with these tokens (registering it if needed), or None
        when the bound is reached and every registered prompt has unfinished requests, or when the
        cache has no room for the prompt's blocks even with every idle prompt released."""
        self._prune()
        known = self.engine.systems.find(token_ids)
        if known is not None:
            self.reuses += 1
            if known in self._used:
                self._used.move_to_end(known)
            return known
        if not self._make_room() or not self.reclaim(self.engine.blocks.blocks_needed([], len(token_ids))):
            return None
        known = self.engine.register_system(token_ids)
        self._used[known] = self.engine.systems.get(known)
        self._used[known].fresh = True
        return known

    def reclaim(self, blocks: int, keep: int | None = None) -> bool:
        """Release idle prompts, least recently used first, until ``blocks`` cache blocks are free;
        whether they are. The scheduler calls this before it leaves a request waiting for blocks or
        preempts one: a prompt nobody follows must not hold the cache against live requests (a few
        long system prompts could otherwise leave a request waiting forever with nothing running).
        ``keep``: a prompt a request about to be added follows (not yet counted as busy)."""
        return self._release_lru_while(lambda: self.engine.blocks.num_free < blocks, keep)

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
        return self._release_lru_while(
            lambda: len(self._used) >= self.max_prompts or self.engine.systems.free_count == 0)

    def _release_lru_while(self, short: Callable[[], bool], keep: int | None = None) -> bool:
        """Release idle prompts (but ``keep``), least recently used first, while ``short()``; False if
        it still is with none idle left."""
        self._prune()
        while short():
            idle = next((sid for sid in self._used if sid != keep and not self.engine.system_busy(sid)), None)
            if idle is None:
                return False
            self._release(idle)
        return True

    def _release(self, sid: int) -> None:
        self.engine.release_system(sid)
        del self._used[sid]
        self.releases += 1
