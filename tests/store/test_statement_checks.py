"""Static checks of the store's statements (app/store/sql/*.sql) and functions
(app/store/functions/*.sql): the fence is in every worker write, NOTIFY appears at most once
per statement and only on the transitions that need it, only the requeue paths can set a run
back to `queued`, and time comes from the injectable clock."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from app.store.statements import parse, statements

FUNCTIONS = {
    path.name.removesuffix(".sql"): path.read_text(encoding="utf-8")
    for path in resources.files("app.store").joinpath("functions").iterdir()
    if path.name.endswith(".sql")
}

WORKER_WRITES = {
    "heartbeat_many",
    "append_event",
    "tool_not_sent",
    "tool_started",
    "tool_finished",
    "save_checkpoint",
    # A refused call's journal entry and event (docs/approvals.md).
    "tool_rejected",
    "take_steered",
    "end_holds",
    # A model call's reservation (budgets.sql): taken only for a run still held.
    "model_budget_reserve",
}
FENCE = re.compile(
    r"(\w+\.)?lease_epoch = (:epoch|held\.epoch|h\.epoch) AND (\w+\.)?status = 'running'"
)
NOTIFYING = {
    "enqueue",
    "enqueue_many",
    "end_holds",
    "deliver_input",
    "cancel_runs",
    # A schedule's next tick is an enqueue (app/store/sql/schedules.sql).
    "create_ticks",
    # An A2A push configuration's caught-up delivery (webhooks.sql), once, when it made one.
    "task_push_catch_up",
    # A note about a session's other turns wakes the session's streams (docs/turn-control.md).
    "turn_event",
    # Live output, on its own channel and connection, bounded by docs/adr/0007 (deltas.sql).
    "publish_deltas",
    # Runs whose booked turn on a model budget came early, made eligible (budgets.sql).
    "model_budget_wake",
}
# Functions that notify, and how many pg_notify calls their text holds: turnstile_submit's two
# are on its two exclusive outcomes (delivered, created), so one call sends one. The creation
# and delivery paths never notify: their callers' one notification covers them.
NOTIFYING_FUNCTIONS = {
    "turnstile_submit": 2,
    "turnstile_promote_turns": 1,
    # One for its whole batch: it calls turnstile_submit with p_notify false.
    "turnstile_submit_many": 1,
}
# turnstile_promote_turns notifies once per run it starts: its callers (end_holds,
# cancel_runs) do not know the new run's session, whose streams must look again, and a
# promotion happens only when a session's run ends with turns waiting behind it.
REQUEUE_PATHS = {"end_holds", "turnstile_deliver_input"}
# Called by the release before migration 0016 without a clock: the database's own time.
UNCLOCKED_FUNCTIONS = {"turnstile_add_queued", "turnstile_clear_work"}


def test_the_worker_writes_are_exactly_the_fenced_statements() -> None:
    fenced = {name for name, s in statements().items() if s.fenced}
    assert fenced == WORKER_WRITES


@pytest.mark.parametrize("name", sorted(WORKER_WRITES))
def test_every_worker_write_asserts_the_fence(name: str) -> None:
    sql = statements()[name].sql
    assert FENCE.search(sql), f"{name} does not assert lease_epoch and status"
    # Rows besides the run itself are written only from the fenced rows: directly (`run`, or
    # `ended`, end_holds' fenced update), through the webhook deliveries' `hook` (runs.sql's
    # fragment), whose one source, `hook_source`, selects from the fenced rows, or through
    # the tenants' counts (count_moves, written from `count_total`, the sums of `moves`),
    # whose `moves` select from the fenced rows.
    inserts = list(re.finditer(r"INSERT INTO (\w+)", sql))
    for i, insert in enumerate(inserts):
        body = sql[insert.end() : inserts[i + 1].start() if i + 1 < len(inserts) else len(sql)]
        assert re.search(r"FROM (run|ended|hook|count_total)\b", body), (
            f"{name}: {insert.group(1)} not from the fence"
        )
    if re.search(r"FROM hook\b", sql):
        source = sql[sql.index("hook_source AS (") : sql.index("hook AS MATERIALIZED")]
        assert re.search(r"FROM (run|ended)\b", source), f"{name}: hook_source not from the fence"
    if "count_total" in sql:
        moves = sql[sql.index("moves AS (") : sql.index("count_total AS MATERIALIZED")]
        sources = set(re.findall(r"FROM (\w+)", moves))
        assert sources & {"run", "ended"}, f"{name}: moves not from the fence"
        assert sources <= {"run", "ended", "hook"}, f"{name}: moves not from the fence"


@pytest.mark.parametrize("name", sorted(statements()))
def test_notify_at_most_once_and_only_where_needed(name: str) -> None:
    count = statements()[name].sql.count("pg_notify(")
    assert count == (1 if name in NOTIFYING else 0)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_notify_only_where_needed(name: str) -> None:
    assert FUNCTIONS[name].count("pg_notify(") == NOTIFYING_FUNCTIONS.get(name, 0)


def test_every_statement_that_expands_the_deliveries_reads_them() -> None:
    """A SELECT in WITH runs only when read: a statement that expands the webhook deliveries
    fragment without reading `hook_run` would create none."""
    for name, statement in statements().items():
        if "hook_run AS (" in statement.sql:
            after = statement.sql[statement.sql.index("hook_link AS (") :]
            assert "FROM hook_run" in after, name


def test_only_the_requeue_paths_set_a_run_queued() -> None:
    texts = {**{n: s.sql for n, s in statements().items()}, **FUNCTIONS}
    requeuing = {
        name
        for name, sql in texts.items()
        if re.search(r"SET status = [^,]*'queued'|THEN 'queued'", sql)
    }
    assert requeuing == REQUEUE_PATHS


def test_time_comes_from_the_injectable_clock() -> None:
    for name, statement in statements().items():
        # now() appears only inside the {{now}} expansion, never on its own.
        assert statement.sql.count("now()") == statement.sql.count(
            "coalesce(CAST(:now AS timestamptz), now())"
        ), name


@pytest.mark.parametrize("name", sorted(set(FUNCTIONS) - UNCLOCKED_FUNCTIONS))
def test_functions_take_their_time_from_the_caller(name: str) -> None:
    """Each function takes `p_now` and reads the database's clock only where it is NULL."""
    body = re.sub(r"--[^\n]*", "", FUNCTIONS[name])  # comments name now() too
    unclocked = body.count("now()") - body.count("coalesce(p_now, now())")
    assert unclocked == 0, f"{name} reads now() {unclocked} times besides coalesce(p_now, now())"


def test_parser_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
