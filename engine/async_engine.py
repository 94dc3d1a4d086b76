"""``AsyncEngine``: one engine loop shared by many concurrent async callers (the server).

The engine is single-threaded, so one background thread owns it: it takes new requests and aborts
from a queue between steps (and at most one ``call`` per step while requests run, so a caller feeding
it a series of long calls, an upload's KV batches, cannot hold a stream's next token back for more
than one of them), runs ``step`` while there is work, and hands each output to its
caller's asyncio queue through that caller's event loop. A caller that stops listening (a client
disconnect cancels its task) aborts its request, which frees its cache blocks.

A request whose start finds the KV cache full (``CacheFullError``: a fused prefill takes its blocks at
once, it does not queue in the scheduler) waits, in arrival order, and starts again after each step
until running requests have freed the room; it fails only when nothing is left running to free any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import CacheFullError, EngineStopped
from .llm_engine import LLMEngine, RequestOutput, RoomMark
from .sampling import SamplingParams

log = logging.getLogger("ragfuse.engine")
T = TypeVar("T")
# Adds one request to the engine and returns its id; runs on the engine thread, so it may also use
# anything else the engine owns (a fused prefill, the KV store it reads).
Starter = Callable[[LLMEngine], str]


@dataclass
class _Submit:
    start: Starter
    out: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    request_id: str | None = None  # set on the engine thread once ``start`` has run


@dataclass
class _Abort:
    sub: _Submit  # the inbox is in order: by the time this is taken, the submission's start has run


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._worker = _EngineLoop(engine)
        # the loop's thread holds the worker, never this front end, which ends the loop when it is
        # collected: dropped without ``shutdown``, it left its thread waiting and the engine (weights,
        # KV cache) alive as long as the process. Called by ``shutdown`` too (it runs once); not at exit,
        # where the daemon thread simply ends with the process
        self._stop = weakref.finalize(self, self._worker.inbox.put, None)
        self._stop.atexit = False

    @property
    def queue_depth(self) -> int:
        """Requests waiting for their first step (for metrics)."""
        return len(self.engine.scheduler.waiting) + len(self._worker.deferred)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last has ``finished``. Bad requests raise at once."""
        params = params or SamplingParams()  # (no id: the engine numbers it, past the ids in use)
        return self.generate_with(lambda engine: engine.add_request(prompt, params, request_id))

    async def generate_with(self, start: Starter) -> AsyncIterator[RequestOutput]:
        """Like ``generate`` for a request that ``start`` adds (e.g. a fused RAG prefill): adding it and
        listening to it happen in one go on the engine thread, so no output can slip by unheard."""
        self._check_open()
        sub = _Submit(start, asyncio.Queue(), asyncio.get_running_loop())
        self._worker.inbox.put(sub)
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
                self._worker.inbox.put(_Abort(sub))  # the caller went away: abort

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (ingest, store reads): the engine and
        what it owns are never touched by two threads at once."""
        self._check_open()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._worker.inbox.put(_Call(fn, done, loop))
        return await done

    def stop(self) -> None:
        """Tell the loop to end without waiting for it: requests still running are aborted and their
        callers told (``_EngineLoop._close``), so streams end with an error instead of running on. For a
        server that is asked to stop (a signal): its streams end at once, not after its grace period."""
        self._stop()

    def shutdown(self, notice_every: float = 10.0) -> None:
        """End the loop (``stop``) and wait for its thread. A step or call it is in runs to its end
        (neither can be cut short), however long that takes (a long prefill on a CPU, an upload's KV
        batch): a caller goes on to close what the engine uses (stores, the session store) and to give
        the engine to others, which must not happen under a running step. It had waited 10 s at most
        and then went on beside it. Logs a line each ``notice_every`` seconds it waits."""
        self.stop()
        thread = self._worker.thread
        if thread is threading.current_thread():  # called from a call on the engine thread: it ends after it
            return
        thread.join(timeout=notice_every)
        while thread.is_alive():
            log.warning("waiting for the engine's current step or call to end before it shuts down")
            thread.join(timeout=notice_every)

    def _check_open(self) -> None:
        if not self._stop.alive:  # nothing would ever take the request: its caller would wait forever
            raise EngineStopped("this AsyncEngine was shut down")


class _EngineLoop:
    """The engine thread's side of an ``AsyncEngine``: what the thread holds while it runs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.Queue[_Submit | _Call | _Abort | None] = queue.Queue()
        self._listeners: dict[str, _Submit] = {}
        self.deferred: deque[_Submit] = deque()  # starts that found the cache full, oldest first
        self._full_at = RoomMark(-1, False)  # what a deferred start last saw when it found no room
        self.thread = threading.Thread(target=self._loop, name="ragfuse-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished() and not self.deferred  # else: starts to retry
            try:
                while True:
                    item = self.inbox.get(block=block)
                    block = False
                    if item is None:
                        self._close()
                        return
                    self._take(item)
                    if isinstance(item, _Call) and self.engine.has_unfinished():
                        break  # one call per step: running streams get a token between an upload's KV batches
            except queue.Empty:
                pass
            self._start_deferred()
            if not self.engine.has_unfinished():
                continue
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

    def _take(self, item: _Submit | _Call | _Abort) -> None:
        if isinstance(item, _Abort):
            rid = item.sub.request_id
            if rid is not None:
                self._listeners.pop(rid, None)
                self.engine.abort(rid)
            elif item.sub in self.deferred:
                self.deferred.remove(item.sub)
            return
        if isinstance(item, _Call):
            self._run_call(item)
            return
        if self.deferred:  # behind the ones already waiting for room
            self.deferred.append(item)
            return
        self._start(item)

    def _start(self, item: _Submit) -> bool:
        """Start a submission; False if the cache has no room for it yet (it waits: ``deferred``)."""
        try:
            item.request_id = item.start(self.engine)
        except CacheFullError as exc:
            if self.engine.has_unfinished():  # running requests will free blocks: try again then
                if item not in self.deferred:
                    self.deferred.append(item)
                self._full_at = self.engine.room_mark()
                return False
            self._fail(item, exc)
            return True
        except Exception as exc:
            self._fail(item, exc)
            return True
        self._listeners[item.request_id] = item
        return True

    def _start_deferred(self) -> None:
        """Start the waiting submissions, oldest first, as far as the cache now has room. Not tried
        before there may be room (``LLMEngine.room_since``, or nothing runs): a start may retrieve,
        look a session up and open stored KV, wasted work at every step while the cache stays full."""
        if self.engine.has_unfinished() and not self.engine.room_since(self._full_at):
            return
        while self.deferred:
            item = self.deferred[0]
            if not self._start(item):
                return
            if self.deferred and self.deferred[0] is item:
                self.deferred.popleft()

    def _close(self) -> None:
        """Requests still running are aborted, their cache blocks freed for the engine's other users
        (an engine shared with ``LLM``), and their callers, like those still waiting for room, are told
        so: they were left waiting forever, and the requests held their blocks in the engine for good."""
        for rid, sub in self._listeners.items():
            self.engine.abort(rid)
            self._fail(sub, EngineStopped("the AsyncEngine was shut down while this request ran"))
        for sub in self.deferred:
            self._fail(sub, EngineStopped("the AsyncEngine was shut down before this request started"))
        self._listeners.clear()
        self.deferred.clear()

    @staticmethod
    def _fail(item: _Submit, exc: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody to tell
            item.loop.call_soon_threadsafe(item.out.put_nowait, exc)

    def _run_call(self, call: _Call) -> None:
        def settle(ok: bool, value: Any) -> None:
            if not call.done.cancelled():
                (call.done.set_result if ok else call.done.set_exception)(value)

        try:
            result, ok = call.fn(self.engine), True
        except Exception as exc:  # handed to the caller, who decides what it means
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody to tell
            call.loop.call_soon_threadsafe(settle, ok, result)

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
