"""Turn control from the command line (issue 33 item 5; docs/turn-control.md): `turnstile
sessions show|set-policy|submit`, `pending-turns list|show|cancel` and `runs cancel --reason`
as real processes against a real database, beside a real server whose API sees what they did;
every bad input is one line, never a traceback."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.processes import run_cli


async def cli(database_url: str, *args: str) -> tuple[int, str, str]:
    return await run_cli(*args, env={"DATABASE_URL": database_url})


async def cli_json(database_url: str, *args: str) -> Any:
    code, out, err = await cli(database_url, *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def refused(database_url: str, *args: str) -> str:
    """The one line a refused command prints (exit status 2, no traceback)."""
    code, out, err = await cli(database_url, *args)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


async def test_a_session_policies_and_turns_from_the_cli(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]

        shown = await cli_json(database_url, "sessions", "show", session)
        assert (shown["multitask"], shown["state"], shown["pending_turns"]) == ("reject", "idle", 0)
        assert (shown["approval"], shown["approval_from"]) == (None, "process default")
        assert shown["tenant"] == "acme"
        code, out, _ = await cli(database_url, "sessions", "show", session)
        assert code == 0
        assert "multitask: reject" in out
        assert "approval_from: process default" in out

        changed = await cli_json(
            database_url,
            "sessions",
            "set-policy",
            session,
            "--multitask",
            "enqueue",
            "--approval-tools",
            "echo,http_request",
            "--approval-classes",
            "unsafe",
        )
        assert changed["multitask"] == "enqueue"
        assert changed["approval"] == {"tools": ["echo", "http_request"], "classes": ["unsafe"]}
        seen = (await client.get(f"/sessions/{session}")).json()
        assert (seen["multitask"], seen["approval"]) == ("enqueue", changed["approval"])
        back = await cli_json(database_url, "sessions", "set-policy", session, "--approval-default")
        assert (back["approval"], back["multitask"]) == (None, "enqueue")

        # A turn to the idle session is a run, with the deadline it asked for.
        first = await cli_json(
            database_url, "sessions", "submit", session, '{"n": 1}', "--start-within", "30"
        )
        assert (first["status"], first["session_id"]) == ("queued", session)
        assert first["start_before"] is not None
        assert (await client.get(f"/runs/{first['id']}")).json()["start_before"] is not None
        # The session is busy: its policy (enqueue) makes the next turn a pending turn...
        waiting = await cli_json(
            database_url, "sessions", "submit", session, '{"n": 2}', "--start-within", "600"
        )
        assert (waiting["kind"], waiting["position"], waiting["active_run_id"]) == (
            "pending_turn",
            1,
            first["id"],
        )
        # ...and a turn that insists on reject is refused, naming the active run.
        busy = await refused(
            database_url, "sessions", "submit", session, "3", "--multitask", "reject"
        )
        assert first["id"] in busy, busy
        shown = await cli_json(database_url, "sessions", "show", session)
        assert (shown["state"], shown["active_run_id"], shown["pending_turns"]) == (
            "busy",
            first["id"],
            1,
        )

        listed = await cli_json(database_url, "pending-turns", "list", session)
        assert [(t["id"], t["position"], t["policy"], t["status"]) for t in listed] == [
            (waiting["id"], 1, "enqueue", "pending")
        ]
        assert listed[0]["accepted_at"] == waiting["created_at"]
        # The pending turn keeps its deadline, which its run will take.
        assert listed[0]["start_before"] == waiting["start_before"] is not None
        one = await cli_json(database_url, "pending-turns", "show", session, waiting["id"])
        assert (
            one == (await client.get(f"/sessions/{session}/pending-turns/{waiting['id']}")).json()
        )

        # A cancel with a reason: the run's event says it, and the pending turn starts.
        cancelled = await cli_json(
            database_url, "runs", "cancel", first["id"], "--reason", "asked twice"
        )
        assert cancelled["status"] == "cancelled"
        [event] = [
            e for e in await api.queue.events(UUID(first["id"])) if e.type == "run.cancelled"
        ]
        assert event.data["reason"] == "asked twice"
        started = await cli_json(database_url, "pending-turns", "show", session, waiting["id"])
        assert (started["status"], started["run_id"]) == ("started", waiting["id"])
        late = await refused(database_url, "pending-turns", "cancel", session, waiting["id"])
        assert f"run {waiting['id']}" in late, late
        assert "runs cancel" in late, late

        # A turn still waiting is withdrawn, and again is the same answer.
        withdrawn = await cli_json(database_url, "sessions", "submit", session, '"later"')
        for _ in range(2):
            again = await cli_json(
                database_url, "pending-turns", "cancel", session, withdrawn["id"]
            )
            assert again["status"] == "cancelled"
        assert await cli_json(database_url, "pending-turns", "list", session) == []

        # An interrupt of a queued run starts the turn at once; the old run says why it ended.
        interrupting = await cli_json(
            database_url, "sessions", "submit", session, '"now"', "--multitask", "interrupt"
        )
        assert (interrupting["status"], interrupting["session_id"]) == ("queued", session)
        assert "kind" not in interrupting  # a run, not a pending turn
        old = (await client.get(f"/runs/{waiting['id']}")).json()
        assert old["status"] == "cancelled"
        # A cancel without --reason keeps the CLI's own.
        await cli_json(database_url, "runs", "cancel", interrupting["id"])
        [event] = [
            e for e in await api.queue.events(UUID(interrupting["id"])) if e.type == "run.cancelled"
        ]
        assert event.data["reason"] == "cancelled from the CLI"


async def test_turn_commands_refuse_bad_input_in_one_line(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]
        turn = "0193c4d2-5b6e-7a8f-9012-3456789abcde"
        for args, named in (
            (("sessions", "show", "nope"), "not a session id"),
            (("sessions", "show", turn), f"session {turn} not found"),
            (("sessions", "show", session, "--tenant", "globex"), "not found in tenant globex"),
            (("sessions", "set-policy", session), "nothing to set"),
            (
                ("sessions", "set-policy", session, "--approval-classes", "risky"),
                "--approval-classes",
            ),
            (("sessions", "set-policy", session, "--approval-tools", "a b"), "--approval-tools"),
            (
                ("sessions", "set-policy", session, "--approval-tools", "x", "--approval-default"),
                "--approval-default",
            ),
            (("sessions", "submit", session, "{oops"), "INPUT_JSON is not JSON"),
            (("sessions", "submit", session, "1", "--start-within", "soon"), "--start-within"),
            (("sessions", "submit", session, "1", "--start-within", "-5"), "start_within"),
            (("pending-turns", "list", session, "--tenant", "globex"), "not found"),
            (("pending-turns", "show", session, "x"), "not a pending turn id"),
            (("pending-turns", "show", session, turn), f"pending turn {turn} not found"),
            (("pending-turns", "cancel", session, turn), f"pending turn {turn} not found"),
            (("runs", "cancel", turn, "--reason", "x" * 501), "--reason"),
        ):
            line = await refused(database_url, *args)
            assert named in line, (args, line)
        # Nothing was written by any of them.
        assert (await client.get(f"/sessions/{session}")).json()["active_run_id"] is None
