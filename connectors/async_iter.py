"""Iterating a blocking generator from async code: the generator runs on a worker thread.

The framework connectors' async methods stream from the pipeline, which drives the engine
synchronously. The worker hands items over through the caller's event loop; when the caller stops
early (a cancelled task, a closed stream), the worker closes the generator at its next item, which
aborts the engine request, and the caller waits for that: once a cancelled call has returned, the
engine no longer holds its request (it neither decodes the rest nor takes room from the next call).

The stream is an object with the async generator's methods, not an ``async def`` generator. The
frameworks wrap it in generators of their own that never close it (LlamaIndex's callback wrapper,
LangChain's ``astream``), so a reader breaking out of ``async for`` left it to asyncio's generator
finaliser, which closes each generator in a task of its own once its wrapper is gone. Inside
``asyncio.run`` that happens while the loop shuts down: the task was destroyed pending ("Task was
destroyed but it is pending!"), or the loop closed the generator a second time meanwhile ("aclose():
asynchronous generator is already running"), and the worker was still decoding when the loop closed.
A stream dropped unclosed needs no task: it stops the worker and hands the wait for it to the loop's
default executor, which ``asyncio.run`` waits for before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
    """What ``make()``'s generator yields (its exceptions are raised here); ``make`` is called on the
    worker, which starts at the first read: a stream never read runs nothing."""
    return _ThreadStream(make)


class _ThreadStream(AsyncGenerator[T, None]):
    """An ``AsyncGenerator`` (as the frameworks check for one, to wrap it) fed by a worker thread."""

    def __init__(self, make: Callable[[], Iterator[T]]) -> None:
        self._make = make
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._joined: asyncio.Future[None] | None = None  # the worker's join, once the stream was closed
        self._ended = False  # read to its end (or its exception), or closed
        self._abandoned: weakref.finalize | None = None  # stops the worker if the stream is dropped unclosed

    async def __anext__(self) -> T:
        if self._ended:
            raise StopAsyncIteration
        if self._thread is None:
            self._start(asyncio.get_running_loop())
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:  # the reader was cancelled: its request ends before it returns
            await self.aclose()
            raise
        if item is _DONE or isinstance(item, BaseException):
            self._end()  # the worker has closed its generator and is returning
            if item is _DONE:
                raise StopAsyncIteration
            raise item
        return item  # type: ignore[return-value]

    async def asend(self, value: None) -> T:
        if value is not None:
            raise TypeError("this stream takes no values: send None (or iterate it)")
        return await self.__anext__()

    async def athrow(self, typ: type[BaseException] | BaseException, val: object = None,
                     tb: TracebackType | None = None) -> T:
        """As into a generator that does not catch it: the stream is closed, then the exception raised."""
        await self.aclose()
        exc = typ if isinstance(typ, BaseException) else typ() if val is None else typ(val)
        raise exc if tb is None else exc.with_traceback(tb)

    async def aclose(self) -> None:
        """Stop the worker at its next item (it closes the generator, aborting the engine request) and
        wait for it, on the default executor: a closer cancelled meanwhile returns at once, and the wait
        goes on there, so ``asyncio.run`` still does not return before the worker has ended."""
        if self._joined is None:
            running = self._thread is not None and not self._ended
            self._end()
            if not running:
                return
            self._stop.set()
            self._joined = asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        await asyncio.shield(self._joined)  # every closer waits, however many there are

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(target=_work, args=(self._make, loop, self._queue, self._stop),
                                        name="ragfuse-connector", daemon=True)
        self._thread.start()
        self._abandoned = weakref.finalize(self, _abandon, loop, self._thread, self._stop)

    def _end(self) -> None:
        self._ended = True
        if self._abandoned is not None:
            self._abandoned.detach()


def _work(make: Callable[[], Iterator[T]], loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object],
          stop: threading.Event) -> None:
    """The worker: ``make()``'s items, then its end or its exception, into ``queue`` on ``loop``."""

    def call(fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            loop.call_soon_threadsafe(fn, *args)

    try:
        gen = make()
        try:
            for item in gen:
                call(queue.put_nowait, item)
                if stop.is_set():
                    break
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()
    except BaseException as exc:  # handed to the caller, raised there
        call(queue.put_nowait, exc)
    else:
        call(queue.put_nowait, _DONE)


def _abandon(loop: asyncio.AbstractEventLoop, thread: threading.Thread, stop: threading.Event) -> None:
    """A stream dropped unclosed (a reader broke out of ``async for``): the worker stops at its next item,
    and its join is left to the loop's default executor, which ``asyncio.run`` waits for at its end. It is
    handed over through the loop, as the collector may run anywhere; a closed loop has nobody to wait."""
    stop.set()
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_join_in_executor, loop, thread)


def _join_in_executor(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is past shutting its executor down: nobody waits
        loop.run_in_executor(None, thread.join)
