"""The operator CLI against a real database: runs show|cancel|resubmit|dismiss|stuck and queue
stats, with --json, and their one-line errors and non-zero exit."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.processes import run_cli


async def cli(database_url: str, *args: str) -> tuple[int, str, str]:
    return await run_cli(*args, env={"DATABASE_URL": database_url})


async def test_runbook_commands(database_url: str, engine: AsyncEngine) -> None:
    queue = Queue(engine)
    queued = await queue.enqueue(
        NewRun(
            tenant_id="acme",
            principal="p",
            agent="scripted",
            input={"n": 1},
            priority=PriorityClass.ASYNC.base,
        )
    )
    failed = await queue.enqueue(
        NewRun(
            tenant_id="acme",
            principal="p",
            agent="scripted",
            input={"n": 2},
            priority=PriorityClass.ASYNC.base,
        )
    )
    claimed = await queue.claim("w", [PriorityClass.ASYNC], limit=2)
    lease = next(c.lease for c in claimed if c.run.id == failed.id)
    await queue.fail(lease, {"kind": "permanent", "message": "bad"})

    code, out, _ = await cli(database_url, "queue", "stats", "--json")
    assert code == 0
    stats: list[dict[str, Any]] = json.loads(out)
    assert {
        "class": "async",
        "status": "running",
        "runs": 1,
        "oldest_eligible_age_seconds": None,
        "live_slots": 0,  # no worker process runs in this test
        "unserved": False,  # nothing of async is queued
    } in stats

    code, out, _ = await cli(database_url, "runs", "show", str(failed.id), "--json")
    assert (code, json.loads(out)["failure"]["kind"]) == (0, "permanent")

    code, out, _ = await cli(database_url, "runs", "resubmit", str(failed.id), "--json")
    assert code == 0
    assert json.loads(out)["resubmitted_from"] == str(failed.id)
    code, out, _ = await cli(database_url, "runs", "dismiss", str(failed.id), "--json")
    assert json.loads(out)["dismissed_at"] is not None

    code, out, _ = await cli(database_url, "runs", "cancel", str(queued.id))
    assert code == 0
    assert "status: cancelled" in out

    code, out, _ = await cli(database_url, "runs", "stuck", "--queued-seconds", "0", "--json")
    assert code == 0
    assert [r["reason"] for r in json.loads(out)] == ["queued_too_long"]  # the resubmitted run
    events = [e.type for e in await queue.events(failed.id)]
    assert events[-2:] == ["operator.resubmitted", "operator.dismissed"]


async def test_runbook_errors_are_one_line(database_url: str, engine: AsyncEngine) -> None:
    queue = Queue(engine)
    done = await queue.enqueue(NewRun(tenant_id="acme", principal="p", agent="scripted", input={}))
    await queue.complete((await queue.claim("w", list(PriorityClass)))[0].lease, {})
    for args, says in [
        (("runs", "show", "not-a-uuid"), "not a run id"),
        (("runs", "show", str(uuid.uuid4())), "not found"),
        (("runs", "cancel", str(done.id)), "is succeeded"),
        (("runs", "dismiss", str(done.id)), "not failed"),
        (("runs", "show", str(done.id), "--tenant", "globex"), "not found"),
    ]:
        code, out, err = await cli(database_url, *args)
        assert code == 2, (args, err)
        assert out == ""
        assert err.startswith("turnstile: ")
        assert says in err
        assert err.strip().count("\n") == 0, err


async def test_schedule_commands(database_url: str, engine: AsyncEngine) -> None:
    code, out, err = await cli(
        database_url,
        "schedules",
        "create",
        "--tenant",
        "acme",
        "--cron",
        "0 3 * * *",
        "--timezone",
        "Europe/Paris",
        "--input",
        '{"script": [{"final": "nightly"}]}',
        "--json",
    )
    assert code == 0, err
    created = json.loads(out)
    assert created["state"] == "active"
    assert created["class"] == "async"
    schedule_id = created["id"]

    code, out, _ = await cli(database_url, "schedules", "list", "--tenant", "acme", "--json")
    assert [s["id"] for s in json.loads(out)] == [schedule_id]
    code, out, _ = await cli(database_url, "schedules", "show", schedule_id, "--json")
    shown = json.loads(out)
    assert len(shown["next_fire_times"]) == 5
    assert shown["next_fire_times"][0].endswith("T02:00:00+00:00")  # 03:00 in Paris, winter
    assert [r["status"] for r in shown["runs"]] == ["queued"]

    code, out, _ = await cli(database_url, "schedules", "pause", schedule_id, "--json")
    assert json.loads(out)["state"] == "paused"
    code, out, _ = await cli(database_url, "schedules", "resume", schedule_id, "--json")
    assert json.loads(out)["state"] == "active"
    code, out, _ = await cli(database_url, "schedules", "show", schedule_id, "--tenant", "globex")
    assert code == 2
    code, out, _ = await cli(database_url, "schedules", "delete", schedule_id, "--json")
    assert json.loads(out) == {"id": schedule_id, "deleted": True, "dropped_runs": 1}

    # Bad input: one line naming what is wrong, exit status 2.
    for args, message in (
        (("--cron", "every day"), "cron:"),
        (("--cron", "* * * * *", "--timezone", "Nowhere/Else"), "timezone:"),
        (("--cron", "* * * * *", "--agent", "nobody"), "unknown agent"),
        (("--cron", "* * * * *", "--input", "{oops"), "--input is not JSON"),
    ):
        code, out, err = await cli(database_url, "schedules", "create", "--tenant", "acme", *args)
        assert code == 2
        assert message in err
        assert len(err.strip().splitlines()) == 1
