"""The TypeScript client's turn control and approvals (clients/typescript/test/turn-control.test.js)
in Node's test runner against a real `turnstile serve` with its worker pool: an enqueued turn
followed to its run, pending turns listed and withdrawn, a full session's 429 not retried, an
interrupt of a running run, a steer, a cancel with its reason, and tool calls approved, edited and
rejected. The server holds at most two pending turns a session, so the 429 comes quickly. And
the clients guide's TypeScript example of turn control and approvals, run in Node.

Without node and npm these skip with a one-line reason; under TURNSTILE_REQUIRE_SYSTEM_TESTS=1
(CI) they fail instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.clients.test_typescript_client import (
    CLIENTS_GUIDE,
    built,
    node,
    serving,
    tap_counts,
)

__all__ = ["built"]  # the fixture, shared with the client's other Node tests

pytestmark = [pytest.mark.system, pytest.mark.slow]

MAX_PENDING = "2"


async def test_turn_control_and_approvals_in_node(
    built: Path, database_url: str, engine: AsyncEngine
) -> None:
    async with serving(database_url, engine, TURNSTILE_MAX_PENDING_TURNS=MAX_PENDING) as served:
        output = await node(
            "--test",
            "--test-reporter=tap",
            "test/turn-control.test.js",
            cwd=built,
            env={
                "TURNSTILE_URL": served.base,
                "TURNSTILE_KEY": served.key,
                "TURNSTILE_MAX_PENDING_TURNS": MAX_PENDING,
            },
        )
    counts = tap_counts(output)
    print(f"node --test: {counts}")
    assert counts["fail"] == 0, output[-6000:]
    assert counts["skipped"] == 0, output[-6000:]  # none skipped for want of a server
    assert counts["cancelled"] == 0, output[-6000:]
    assert counts["pass"] == counts["tests"] == 6


def guide_example(opening: str) -> str:
    """The guide's first `ts` block after the paragraph that starts with `opening`."""
    section = CLIENTS_GUIDE.read_text(encoding="utf-8").split(f"\n{opening}", 1)[1]
    return section.split("```ts\n", 1)[1].split("```", 1)[0]


async def test_the_guides_turn_control_example_runs_in_node(
    built: Path, database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    example = guide_example("Turn control and approvals from Node")
    assert 'from "@turnstile/client"' in example
    # A project of the user's: the package linked in as npm would install it.
    (tmp_path / "node_modules" / "@turnstile").mkdir(parents=True)
    (tmp_path / "node_modules" / "@turnstile" / "client").symlink_to(built)
    async with serving(database_url, engine) as served:
        (tmp_path / "example.mjs").write_text(example.replace("http://127.0.0.1:8000", served.base))
        output = await node("example.mjs", cwd=tmp_path, env={"TURNSTILE_KEY": served.key})
    lines = output.splitlines()
    assert lines[:2] == ["1", "started"], output
    assert "final: 'second'" in lines[2], output
    assert lines[3:] == ["echo", "succeeded"], output
