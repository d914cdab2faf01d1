"""Static checks of the queue's statements (app/store/sql/*.sql): the fence is in every worker
write, NOTIFY appears at most once per statement and only on the transitions that need it, and
only the four requeue paths can set a run back to `queued`."""

from __future__ import annotations

import re

import pytest

from app.store.statements import parse, statements

WORKER_WRITES = {
    "heartbeat_many",
    "append_event",
    "tool_not_sent",
    "tool_started",
    "tool_finished",
    "save_checkpoint",
    "wait_for_user",
    "complete",
    "complete_many",
    "fail",
    "release_graceful",
    "release_early",
}
FENCE = re.compile(r"(\w+\.)?lease_epoch = (:epoch|held\.epoch) AND (\w+\.)?status = 'running'")
NOTIFYING = {
    "enqueue",
    "enqueue_many",
    "wait_for_user",
    "complete",
    "complete_many",
    "fail",
    "release_graceful",
    "release_early",
    "sweep_expired",
    "deliver_input",
    "cancel",
    # A schedule's next tick is an enqueue (app/store/sql/schedules.sql).
    "create_ticks",
    # Live output, on its own channel and connection, bounded by docs/adr/0007 (deltas.sql).
    "publish_deltas",
}
REQUEUE_PATHS = {"sweep_expired", "release_graceful", "release_early", "deliver_input"}


def test_the_worker_writes_are_exactly_the_fenced_statements() -> None:
    fenced = {name for name, s in statements().items() if s.fenced}
    assert fenced == WORKER_WRITES


@pytest.mark.parametrize("name", sorted(WORKER_WRITES))
def test_every_worker_write_asserts_the_fence(name: str) -> None:
    sql = statements()[name].sql
    assert FENCE.search(sql), f"{name} does not assert lease_epoch and status"
    # Rows besides the run itself are written only from the fenced UPDATE's result: directly,
    # or through the webhook deliveries' `hook` and `hook_body` (runs.sql's fragment), whose
    # one source, `hook_source`, selects from the fenced result, or through the tenants' counts
    # (runs.sql's count_moves, written from `move_total`, the sums of `moves`), whose `moves`
    # select from the fenced result and its deliveries only.
    inserts = list(re.finditer(r"INSERT INTO (\w+)", sql))
    for i, insert in enumerate(inserts):
        body = sql[insert.end() : inserts[i + 1].start() if i + 1 < len(inserts) else len(sql)]
        assert re.search(r"FROM (run|hook|hook_body|move_total)\b", body), (
            f"{name}: {insert.group(1)} not from the fence"
        )
    if re.search(r"FROM hook\b", sql):
        source = sql[sql.index("hook_source AS (") : sql.index("hook AS MATERIALIZED")]
        assert re.search(r"FROM run\b", source), f"{name}: hook_source not from the fence"
    if "move_total" in sql:
        moves = sql[sql.index("moves AS (") : sql.index("move_total AS MATERIALIZED")]
        sources = set(re.findall(r"FROM (\w+)", moves))
        assert "run" in sources, f"{name}: moves not from the fence"
        assert sources <= {"run", "hook"}, f"{name}: moves not from the fence"


@pytest.mark.parametrize("name", sorted(statements()))
def test_notify_at_most_once_and_only_where_needed(name: str) -> None:
    count = statements()[name].sql.count("pg_notify(")
    assert count == (1 if name in NOTIFYING else 0)


def test_only_the_requeue_paths_set_a_run_queued() -> None:
    requeuing = {
        name for name, s in statements().items() if re.search(r"SET status = [^,]*'queued'", s.sql)
    }
    assert requeuing == REQUEUE_PATHS


def test_time_comes_from_the_injectable_clock() -> None:
    for name, statement in statements().items():
        # now() appears only inside the {{now}} expansion, never on its own.
        assert statement.sql.count("now()") == statement.sql.count(
            "coalesce(CAST(:now AS timestamptz), now())"
        ), name


def test_parser_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
