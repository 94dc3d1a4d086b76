"""Iterating a blocking generator from async code: the generator runs on a worker thread.

The framework connectors' async methods stream from the pipeline, which drives the engine
synchronously. The worker hands items over through the caller's event loop; when the caller stops
early (a cancelled task, a closed stream), the worker closes the generator at its next item, which
aborts the engine request, and the caller waits for that: once a cancelled call has returned, the
engine no longer holds its request (it neither decodes the rest nor takes room from the next call).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield what ``make()``'s generator yields; its exceptions are raised here."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    ended: asyncio.Future[None] = loop.create_future()
    stop = threading.Event()

    def call(fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            loop.call_soon_threadsafe(fn, *args)

    def mark_ended() -> None:
        if not ended.done():  # a caller cancelled again while waiting for the worker cancels the future
            ended.set_result(None)

    def work() -> None:
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
        finally:
            call(mark_ended)

    thread = threading.Thread(target=work, name="ragfuse-connector", daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        await ended  # the worker closes the generator at its next item (one engine step at most)
