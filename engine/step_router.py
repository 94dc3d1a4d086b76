"""``StepRouter``: synchronous callers sharing one engine, each reading only its own request's outputs.

The engine is single-threaded and one ``step`` advances every request in it. Front ends that step it
themselves (``LLM.generate``/``stream``, the RAG pipeline, hence the LangChain and LlamaIndex
wrappers) used to hold a lock for a whole request and drop the outputs of requests that were not
theirs. Then a stream read halfway and a second call on the same thread deadlocked on that lock, and
two open streams stole each other's tokens. Here the lock is held only while the engine is touched
(adding a request, one step), never while a caller holds a yielded output: whoever needs an output
steps the engine and files every request's outputs in its box, so streams can interleave on one
thread or run on several at once (and share batches). A stream closed early (or garbage-collected)
leaves its id in a queue that the next caller settles, aborting the request, since a finaliser may
run anywhere, also inside a locked step.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator

from .llm_engine import LLMEngine, RequestOutput

_ROUTERS: weakref.WeakKeyDictionary[LLMEngine, StepRouter] = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


class StepRouter:
    def __init__(self, engine: LLMEngine) -> None:
        # weakly: ``_ROUTERS`` keeps a router while its engine lives, so a strong reference here made
        # every engine ever stepped (weights, KV cache) live as long as the process
        self._engine = weakref.ref(engine)
        # held while the engine is touched, never across a yield; callers add requests under it and
        # ``track`` them before releasing it, so no step can run between the two
        self.lock = threading.Lock()
        self._boxes: dict[str, deque[RequestOutput]] = {}
        self._closed: deque[tuple[str, bool]] = deque()  # (request id, finished) of streams that ended

    @property
    def engine(self) -> LLMEngine:
        """The engine routed; every caller that steps it holds it, so it is gone only after they are."""
        engine = self._engine()
        if engine is None:
            raise RuntimeError("this StepRouter's engine was garbage-collected: its requests ended with it")
        return engine

    @classmethod
    def of(cls, engine: LLMEngine) -> StepRouter:
        """The one router of ``engine`` (every front end over an engine must share it)."""
        with _ROUTERS_LOCK:
            router = _ROUTERS.get(engine)
            if router is None:
                router = _ROUTERS[engine] = cls(engine)
            return router

    def track(self, request_id: str) -> None:
        """Keep ``request_id``'s outputs from now on. Call it holding ``lock``, right after adding it."""
        self.settle()
        self._boxes[request_id] = deque()

    def settle(self) -> None:
        """Forget the streams that ended, aborting the requests they left unfinished (holding ``lock``).
        A stream collected together with its engine is settled after the engine is gone (the collector
        clears weak references before it runs finalisers): its request went with the engine."""
        engine = self._engine()
        while self._closed:
            rid, finished = self._closed.popleft()
            self._boxes.pop(rid, None)
            if not finished and engine is not None:
                engine.abort(rid)

    def outputs(self, request_id: str) -> Iterator[RequestOutput]:
        """``request_id``'s outputs as they come; the last has ``finished``. Closing the iterator
        early aborts the request."""
        finished = False
        try:
            while not finished:
                with self.lock:
                    ready = self._next(request_id)
                for out in ready:
                    finished = out.finished
                    yield out
                    if finished:
                        break
        finally:
            self._ended(request_id, finished)

    def _ended(self, request_id: str, finished: bool) -> None:
        """A stream of ``request_id`` ended: forget it, aborting it unless it ``finished``."""
        self._closed.append((request_id, finished))
        if self.lock.acquire(blocking=False):  # else (a finaliser inside a step) the next caller settles
            try:
                self.settle()
            finally:
                self.lock.release()

    def collect(
        self, request_ids: list[str], on_finished: Callable[[RequestOutput], object] | None = None
    ) -> list[RequestOutput]:
        """The last output of each request (in ``request_ids`` order), stepping until all finished;
        an exception (Ctrl-C included) aborts the ones left. ``on_finished`` sees each last output
        as it is read (in that order too: a request that ends early waits in its box)."""
        last: dict[str, RequestOutput] = {}
        streams: dict[str, Iterator[RequestOutput]] = {}
        try:
            for rid in request_ids:
                streams[rid] = stream = self.outputs(rid)
                for out in stream:
                    last[rid] = out
                if on_finished is not None:
                    on_finished(last[rid])
        finally:
            for stream in streams.values():
                stream.close()
            # a stream never started has no ``finally`` to run: its request is ended here, else it
            # went on running unread, its box filling with outputs for good
            for rid in request_ids[len(streams):]:
                self._ended(rid, False)
        return [last[rid] for rid in request_ids]

    def _next(self, request_id: str) -> list[RequestOutput]:
        """The outputs filed for ``request_id``, stepping the engine until there is one (holding ``lock``)."""
        self.settle()
        box = self._boxes[request_id]
        while not box:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {request_id} ended without its last output (aborted elsewhere?)")
            for out in self.engine.step():
                filed = self._boxes.get(out.request_id)
                if filed is not None:
                    filed.append(out)
        ready = list(box)
        box.clear()
        return ready
