"""Turnstile as real OS processes in tests: one-shot CLI commands, and long-running roles
(`serve`, `worker`) started, waited for until ready, and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


async def run_cli(*args: str, env: dict[str, str], cwd: str | None = None) -> tuple[int, str, str]:
    """Run `turnstile ARGS` to completion: (exit status, stdout, stderr). Run in another
    checkout (`cwd`: another release's, from a git worktree), that checkout's code runs:
    `python -m` puts its working folder first on the path."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        cwd=cwd,
    )
    out, err = await process.communicate()
    return int(process.returncode or 0), out.decode(), err.decode()


@dataclass
class Child:
    process: asyncio.subprocess.Process
    log: bytearray = field(default_factory=bytearray)  # everything it wrote to stderr


@asynccontextmanager
async def turnstile(
    *args: str,
    ready: bytes,
    env: dict[str, str],
    program: Sequence[str] = (sys.executable, "-m", "app.cli"),
    cwd: str | None = None,
) -> AsyncIterator[Child]:
    """Start `turnstile ARGS` (`program`: another installation's `turnstile` command, say),
    wait for a stderr line containing `ready`, and keep reading its log so a full pipe never
    blocks it. On the way out, a process still running gets SIGTERM and must drain and exit 0;
    one the test killed itself is only reaped. `env` adds to this process's environment."""
    process = await asyncio.create_subprocess_exec(
        *program,
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        cwd=cwd,
    )
    child = Child(process)
    stderr = process.stderr
    assert stderr is not None
    reading: asyncio.Task[None] | None = None
    try:
        while ready not in (line := await asyncio.wait_for(stderr.readline(), 60)):
            assert line, (
                f"turnstile {' '.join(args)} exited before it was ready:\n"
                + child.log.decode(errors="replace")[-3000:]
            )
            child.log.extend(line)
        child.log.extend(line)

        async def read_rest() -> None:
            while chunk := await stderr.read(65536):
                child.log.extend(chunk)

        reading = asyncio.create_task(read_rest())
        yield child
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 60) == 0
        await asyncio.wait_for(process.wait(), 60)
        await reading
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if reading is not None and not reading.done():
            reading.cancel()
