"""``AsyncEngine``: one engine loop shared by many concurrent async callers (the server).

The engine is single-threaded, so one background thread owns it: it takes new requests and aborts
from a queue between steps, runs ``step`` while there is work, and hands each output to its
caller's asyncio queue through that caller's event loop. A caller that stops listening (a client
disconnect cancels its task) aborts its request, which frees its cache blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("ragfuse.engine")


@dataclass
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    out: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Submit | str | None] = queue.Queue()
        self._listeners: dict[str, _Submit] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="ragfuse-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for their first step (for metrics)."""
        return len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last has ``finished``. Bad requests raise at once."""
        rid = request_id or f"async-{next(self._ids)}"
        sub = _Submit(rid, prompt, params or SamplingParams(), asyncio.Queue(), asyncio.get_running_loop())
        self._inbox.put(sub)
        finished = False
        try:
            while True:
                item = await sub.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(rid)  # the caller went away: abort

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            try:
                while True:
                    item = self._inbox.get(block=block)
                    block = False
                    if item is None:
                        return
                    self._take(item)
            except queue.Empty:
                pass
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not leave callers waiting forever
                log.exception("engine step failed")
                for rid in list(self._listeners):
                    self._deliver(rid, exc)
                    self.engine.abort(rid)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _take(self, item: _Submit | str) -> None:
        if isinstance(item, str):
            self._listeners.pop(item, None)
            self.engine.abort(item)
            return
        try:
            self.engine.add_request(item.prompt, item.params, item.request_id)
        except Exception as exc:
            item.loop.call_soon_threadsafe(item.out.put_nowait, exc)
            return
        self._listeners[item.request_id] = item

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        sub = self._listeners.get(rid)
        if sub is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._listeners[rid]
        try:
            sub.loop.call_soon_threadsafe(sub.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            self.engine.abort(rid)
