"""`Turnstile`: the blocking client, for code without an event loop. It is not a second
implementation: each method runs `AsyncTurnstile`'s method of the same name (aio.py), with the
same retries, long polls and stream resumption, on an event loop the client keeps in a thread
of its own, and waits for the result; event streams are iterated the same way, item by item.

The loop thread is made with the client and stopped by `close()` (or the `with` block), so one
client serves many calls, from any thread (the calls share one connection pool). Interrupting
a call (Ctrl-C) cancels it on the loop as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from turnstile_client.aio import AsyncTurnstile
from turnstile_client.retry import RetryPolicy

P = ParamSpec("P")
T = TypeVar("T")


class _LoopThread:
    """An asyncio event loop running in a daemon thread, and a way to wait for a coroutine on
    it from another thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="turnstile-client", daemon=True
        )
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():
            coroutine.close()
            raise RuntimeError("this Turnstile client is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (KeyboardInterrupt): stop the call too; else a no-op
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is self._thread:
            return  # collected on the loop's own thread: it stops after this callback
        self._thread.join()
        self.loop.close()


async def _next(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)


def _blocking(
    method: Callable[Concatenate[AsyncTurnstile, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Turnstile, P], T]:
    """`AsyncTurnstile.method` as a blocking method of `Turnstile`."""

    @functools.wraps(method)
    def call(self: Turnstile, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._loop.run(method(self._client, *args, **kwargs))

    return call


def _blocking_stream(
    method: Callable[Concatenate[AsyncTurnstile, P], AsyncGenerator[T, None]],
) -> Callable[Concatenate[Turnstile, P], Iterator[T]]:
    """`AsyncTurnstile.method`, an async generator, as a blocking generator of `Turnstile`:
    leaving the loop early (or closing the generator) closes the stream."""

    @functools.wraps(method)
    def call(self: Turnstile, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        stream = method(self._client, *args, **kwargs)
        try:
            while True:
                try:
                    item = self._loop.run(_next(stream))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # After an interrupted step the generator may still be finishing its cancellation
            # ("already running"); it closes its connection as it ends either way.
            if not self._loop.loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    self._loop.run(stream.aclose())

    return call


class Turnstile:
    """The API at `base_url`, as the holder of `api_key`, for blocking code: the methods of
    `AsyncTurnstile`, returning their results. Use it as a context manager, or call `close()`
    when done."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._client = AsyncTurnstile(
            base_url, api_key, timeout=timeout, retry=retry, transport=transport
        )
        self._loop = _LoopThread()
        # A client dropped without close() still stops its thread when it is collected.
        weakref.finalize(self, self._loop.stop)

    @property
    def base_url(self) -> str:
        return self._client.base_url

    @property
    def retry(self) -> RetryPolicy:
        return self._client.retry

    @property
    def timeout(self) -> float:
        return self._client.timeout

    def __enter__(self) -> Turnstile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the client's loop thread."""
        if not self._loop.loop.is_closed():
            self._loop.run(self._client.aclose())
            self._loop.stop()

    create_session = _blocking(AsyncTurnstile.create_session)
    get_session = _blocking(AsyncTurnstile.get_session)
    set_multitask = _blocking(AsyncTurnstile.set_multitask)
    set_approval = _blocking(AsyncTurnstile.set_approval)
    approve = _blocking(AsyncTurnstile.approve)
    reject = _blocking(AsyncTurnstile.reject)
    edit = _blocking(AsyncTurnstile.edit)
    list_pending_turns = _blocking(AsyncTurnstile.list_pending_turns)
    get_pending_turn = _blocking(AsyncTurnstile.get_pending_turn)
    cancel_pending_turn = _blocking(AsyncTurnstile.cancel_pending_turn)
    submit_turn = _blocking(AsyncTurnstile.submit_turn)
    answer = _blocking(AsyncTurnstile.answer)
    submit_run = _blocking(AsyncTurnstile.submit_run)
    get_run = _blocking(AsyncTurnstile.get_run)
    wait = _blocking(AsyncTurnstile.wait)
    cancel = _blocking(AsyncTurnstile.cancel)
    events = _blocking_stream(AsyncTurnstile.events)
    session_events = _blocking_stream(AsyncTurnstile.session_events)
