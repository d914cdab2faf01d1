"""Waiting on rows and events, never on fixed sleeps: poll a condition until it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T | None]], *, within: float = 15.0, what: str = "condition"
) -> T:
    """Await `check()` until it returns neither None nor False; fail after `within` seconds."""
    deadline = time.monotonic() + within
    delay = 0.005
    while True:
        result = await check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
