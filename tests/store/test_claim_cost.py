"""The claim's cost does not grow with the queue.

For every eligibility set a worker slot can have (each class alone, interactive+async, the
non-contiguous interactive+maintenance, all three), this module runs the real `claim` statement
(the claim function turnstile_claim, for one run and for a batch), with the bind parameters
`Queue.claim` passes, against a queue of 1k and of 100k runs, with custom plans and with the
generic plans the claim engine's connections keep (app/store/engine.py), and reads the plans of
every statement it runs through auto_explain (tests/support/nested_plans.py), to prove that:

- the plan never scans the table (no Seq Scan) and never sorts the queue (no Sort of more rows
  than a batch and its tenants): the fair claim (docs/adr/0006) walks the tenants with queued
  runs (`tenant_class_counts`, here one tenant) and probes `ix_runs_tenant_claim` with the
  tenant, one priority and the eligibility bound as index conditions, so each priority of the
  set is one bounded index range read in order. (One exception, measured and kept visible in
  the printed table: on the 1k-run table, some twenty pages, the planner may read the whole
  table for `claim_many`; see `small_table_choice`);
- the shared buffers the statement touches at 100k are at most twice those at 1k, whether the
  100k runs are other classes' eligible backlog, the set's own backed-off runs sitting at the
  head of the queue by age, or backed-off runs alone with nothing to claim;
- the claim still takes the right run: the set's lowest priority, longest eligible (eligibility
  being `coalesce(scheduled_for, created_at)`, not `created_at`).

The figures are printed (run with `-s`); docs/adr/0001-claim-order-by-eligibility.md quotes them.
Every EXPLAIN ANALYZE really claims rows, so each runs in a transaction that is rolled back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.engine import CLAIM_PLANNER_SETTINGS, create_engine
from app.store.statements import statements
from app.vocabulary.classes import PriorityClass, priorities_of
from tests.support.databases import clone_database, drop_database
from tests.support.nested_plans import AutoExplainMissing, NestedPlan, start_explaining
from tests.support.system_tools import require_or_skip

SMALL = 1_000
LARGE = 100_000
# Eligible runs of each class: enough that a claim has a real choice, few enough that the
# queue's size, not theirs, is what varies between the two measurements.
HANDFUL = 20
# claim_many's :limit: more than one class's handful, so a two-class batch crosses a class.
BATCH = 25
OWNER = "claim-cost-test"
LEASE_SECONDS = 30.0

INTERACTIVE = PriorityClass.INTERACTIVE
ASYNC = PriorityClass.ASYNC
MAINTENANCE = PriorityClass.MAINTENANCE

PlanNode = dict[str, Any]


@dataclass(frozen=True)
class EligibilitySet:
    name: str
    classes: tuple[PriorityClass, ...]
    # The class not in the set whose eligible backlog scenario "other" fills. One class is
    # enough: the statement's cost depends on where the backlog sits in the index relative to
    # the set's priorities (before, between, after), and the choices below cover all three.
    backlog: PriorityClass | None


SETS = (
    EligibilitySet("interactive", (INTERACTIVE,), backlog=ASYNC),  # backlog after the set
    EligibilitySet("async", (ASYNC,), backlog=MAINTENANCE),  # after
    EligibilitySet("maintenance", (MAINTENANCE,), backlog=ASYNC),  # before
    EligibilitySet("interactive+async", (INTERACTIVE, ASYNC), backlog=MAINTENANCE),  # after
    # Non-contiguous bands, with the backlog between them.
    EligibilitySet("interactive+maintenance", (INTERACTIVE, MAINTENANCE), backlog=ASYNC),
    # With all three classes there is no other class to hold a backlog: scenario "other" does
    # not exist for this set. Its 1k-vs-100k comparison is scenarios "backed-off" and
    # "none-eligible", where every one of its own classes holds the backlog, backed off.
    EligibilitySet("all", (INTERACTIVE, ASYNC, MAINTENANCE), backlog=None),
)

# The three ways the 1k/100k runs are arranged, one database per arrangement and size:
# - "other": SIZE eligible runs of one class outside the set (older than the set's own
#   eligible runs, so by age alone they are the head of the queue), plus every class's handful.
# - "backed-off": SIZE runs of every class created a day ago but retried with scheduled_for an
#   hour ahead (so by created_at they are the head of the queue; by eligibility, the tail), plus
#   every class's handful. The set's own lowest class is among them.
# - "none-eligible": the same database with every eligible run deleted inside the measuring
#   transaction: the claim must find nothing, and find it cheaply.
SCENARIOS = ("other", "backed-off", "none-eligible")
# The claim of one run and of a batch (the statement `claim`, :limit 1 or BATCH).
STATEMENTS = ("claim_one", "claim_many")
# How each statement is planned: for its parameters at every call (its first executions on any
# connection, and behind PgBouncer), and as the service claims, on the claim engine's
# connections with one generic plan kept per connection (app/store/engine.py).
PLANNINGS = ("per call", "claim engine")
PLAN_CACHE_MODE = {"per call": "force_custom_plan", "claim engine": "force_generic_plan"}

HANDFUL_SQL = """
INSERT INTO runs (tenant_id, principal, agent, input, priority, status, created_at,
                  scheduled_for)
SELECT 'tenant', 'principal', 'eligible-' || c.name || '-' || k, '{}'::jsonb, c.base, 'queued',
       -- k = 0 was created first but failed once and waited a backoff that ended a minute ago:
       -- the oldest by created_at, the youngest by eligibility. The claim must prefer k = 1.
       CASE WHEN k = 0 THEN now() - interval '20 minutes'
            ELSE now() - interval '10 minutes' + k * interval '1 second' END,
       CASE WHEN k = 0 THEN now() - interval '1 minute' END
FROM (VALUES ('interactive', 0), ('async', 10), ('maintenance', 20)) AS c(name, base),
     generate_series(0, CAST(:handful AS integer) - 1) AS k
"""

BACKLOG_SQL = """
INSERT INTO runs (tenant_id, principal, agent, input, priority, status, created_at)
SELECT 'tenant', 'principal', 'backlog', '{}'::jsonb, CAST(:priority AS smallint), 'queued',
       now() - interval '2 days' + g * interval '1 millisecond'
FROM generate_series(1, CAST(:size AS integer)) AS g
"""

BACKED_OFF_SQL = """
INSERT INTO runs (tenant_id, principal, agent, input, priority, status, attempts, created_at,
                  scheduled_for)
SELECT 'tenant', 'principal', 'backed-off', '{}'::jsonb, c.base, 'queued', 1,
       now() - interval '1 day' + g * interval '1 millisecond',
       now() + interval '1 hour' + g * interval '1 millisecond'
FROM (VALUES (0), (10), (20)) AS c(base), generate_series(1, CAST(:size AS integer)) AS g
"""

# Every eligible run, found through the claim index (scenario "none-eligible").
DELETE_ELIGIBLE_SQL = """
DELETE FROM runs
WHERE status = 'queued' AND priority = ANY(CAST(:priorities AS smallint[]))
  AND coalesce(scheduled_for, created_at) <= now()
"""

# The tenants' count rows of the runs inserted directly: running counted, has_work where a
# queued run is eligible (as migration 0016 fills them in).
COUNTS_SQL = """
INSERT INTO tenant_class_counts (tenant_id, band, running, has_work)
SELECT tenant_id, priority / 10, count(*) FILTER (WHERE status = 'running'),
       count(*) FILTER (WHERE status = 'queued'
                        AND coalesce(scheduled_for, created_at) <= now()) > 0
FROM runs WHERE status IN ('queued', 'running')
GROUP BY tenant_id, priority / 10
"""
# The claim's process defaults of the tenants' concurrency limits: none.
NO_LIMITS: list[int | None] = [None, None, None]

# What the EXPLAIN ANALYZE claimed, read back inside its transaction before the rollback.
CLAIMED_SQL = """
SELECT agent FROM runs WHERE status = 'running' AND lease_owner = :owner
ORDER BY priority, coalesce(scheduled_for, created_at)
"""


@dataclass(frozen=True)
class Figure:
    eligibility: str
    classes: tuple[PriorityClass, ...]
    scenario: str
    size: int
    statement: str
    planning: str
    # Shared buffers (hit + read) of the claim statement's top plan node, which counts every
    # statement its function ran: the walk, the candidate search, the row locks, the UPDATE
    # and the run.claimed events.
    buffers: int
    # The same for the candidate search alone: the scans of runs aliased q (the probes of
    # ix_runs_tenant_claim) that ran.
    search_buffers: int
    execution_ms: float
    # Every statement's plan the claim ran, as the children of one root.
    plan: PlanNode
    claimed: tuple[str, ...]
    expected: tuple[str, ...]


def nodes(node: PlanNode) -> Iterator[PlanNode]:
    """Every node of the plan tree. In FORMAT JSON, InitPlans, SubPlans and CTEs are children
    in "Plans" too (told apart by "Parent Relationship"), so walking "Plans" reaches them."""
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def shared_buffers(node: PlanNode) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def claim_search(plan: PlanNode) -> list[PlanNode]:
    """The scans that choose the candidates: the scans of runs aliased q that ran (the
    deliveries' probe of a tenant at its limit never runs here: no limit is set)."""
    search = [
        node
        for node in nodes(plan)
        if node.get("Alias") == "q" and int(node.get("Actual Loops", 0)) > 0
    ]
    assert search, "no candidate search ran"
    return search


def tolerated(node: PlanNode) -> bool:
    """What the fair claim may scan or sort whatever the queue: its walk's small table
    (`tenant_class_counts`, a row per tenant and class; here three) and Sorts of the rows a
    batch picked (at most its share of each tenant of each class it walked, so at most the
    batch size, plus one per tenant, per class: here 3 x 26), never of the queue."""
    if node["Node Type"] == "Seq Scan":
        return node.get("Relation Name") == "tenant_class_counts"
    if node["Node Type"] == "Sort":
        return int(node["Actual Rows"]) <= len(PriorityClass) * (BATCH + 1)
    return False


def small_table_choice(figure: Figure, node: PlanNode) -> bool:
    """A Seq Scan or Sort tolerated in one case only: claim_many on the 1k-run table.

    There (about 1,060 rows, some twenty pages) the planner prices reading the whole table as
    cheaper than :limit index probes, and takes, from one run to the next, a Seq Scan or a bitmap
    scan of the candidates followed by a Sort of the set's eligible runs, and a Seq Scan for the
    UPDATE's `id = ANY(...)` lookup. That costs what the 1k table costs; the planner sizes the
    table from its current pages, not from its statistics, so a grown queue never keeps that
    plan, and at 100k every plan is asserted strictly. What stays forbidden even here: a Sort of
    more rows than the set's eligible runs (that would be sorting the backlog)."""
    if figure.size != SMALL or figure.statement != "claim_many":
        return False
    if node["Node Type"] == "Seq Scan":
        return True
    if node["Node Type"] == "Sort":
        return int(node["Actual Rows"]) <= HANDFUL * len(figure.classes)
    return False


def scans_and_sorts(figure: Figure) -> list[PlanNode]:
    """Every Seq Scan and Sort of the plan, but those the fair claim always may make."""
    return [
        node
        for node in nodes(figure.plan)
        if node["Node Type"] in ("Seq Scan", "Sort") and not tolerated(node)
    ]


def plan_shape(figure: Figure) -> str:
    """For the printed table: "ordered" when the plan is the ordered index walk, else what the
    planner did instead."""
    other = [
        f"{node['Node Type']} {node.get('Alias', '')}".strip() for node in scans_and_sorts(figure)
    ]
    for search in claim_search(figure.plan):
        if search["Node Type"] not in ("Index Scan", "Index Only Scan", "Seq Scan"):
            other.insert(0, f"{search['Node Type']} q")
    return ", ".join(other) or "ordered"


def expected_claims(eligibility: EligibilitySet, scenario: str, statement: str) -> tuple[str, ...]:
    """The eligible runs of the set in claim order: lowest class first, then by eligibility,
    which puts each class's k = 0 (retried, eligible a minute ago) after its k = 1..19."""
    if scenario == "none-eligible":
        return ()
    order = [
        f"eligible-{klass.value}-{k}"
        for klass in sorted(eligibility.classes, key=lambda c: c.base)
        for k in [*range(1, HANDFUL), 0]
    ]
    return tuple(order[: 1 if statement == "claim_one" else BATCH])


async def populate(engine: AsyncEngine, layout: str, size: int) -> None:
    async with engine.begin() as conn:
        # INSERT ... SELECT FROM generate_series: 100k rows in about a second, where enqueue
        # would take minutes. The claim reads only runs, so no run.created events are made.
        await conn.execute(text(HANDFUL_SQL), {"handful": HANDFUL})
        if layout == "backed-off":
            await conn.execute(text(BACKED_OFF_SQL), {"size": size})
        else:
            backlog = PriorityClass(layout.removeprefix("backlog:"))
            await conn.execute(text(BACKLOG_SQL), {"priority": backlog.base, "size": size})
        # The runs were inserted directly: their tenant's counts, as migration 0010 fills them.
        await conn.execute(text(COUNTS_SQL))
    async with engine.connect() as conn:
        # Fresh statistics, as autovacuum would have them on a queue this size.
        await conn.execute(text("ANALYZE runs"))
        await conn.commit()
        # One claim, rolled back, before any measurement: a connection's first index scan reads
        # the index's metapage, which it then caches, as a worker's long-lived connection has.
        transaction = await conn.begin()
        await conn.execute(
            statements()["claim"].clause,
            {
                "owner": OWNER,
                "priorities": priorities_of(PriorityClass),
                "lease_seconds": LEASE_SECONDS,
                "max_running": NO_LIMITS,
                "limit": 1,
                "now": None,
                "claim": None,
            },
        )
        await transaction.rollback()


async def measure(
    engine: AsyncEngine,
    eligibility: EligibilitySet,
    scenario: str,
    size: int,
    statement: str,
    planning: str,
) -> Figure:
    params: dict[str, Any] = {
        "owner": OWNER,
        "priorities": priorities_of(eligibility.classes),
        "lease_seconds": LEASE_SECONDS,
        "max_running": NO_LIMITS,
        "limit": 1 if statement == "claim_one" else BATCH,
        "now": None,
        "claim": None,
    }
    async with engine.connect() as conn:
        try:
            plans: list[NestedPlan] = await start_explaining(conn)
        except AutoExplainMissing as missing:
            require_or_skip("auto_explain", str(missing))
            raise
        settings = {**CLAIM_PLANNER_SETTINGS, "plan_cache_mode": PLAN_CACHE_MODE[planning]}
        if planning == "per call":
            settings = {"plan_cache_mode": PLAN_CACHE_MODE[planning]}
        transaction = await conn.begin()
        try:
            if scenario == "none-eligible":
                await conn.execute(
                    text(DELETE_ELIGIBLE_SQL), {"priorities": priorities_of(PriorityClass)}
                )
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            for setting, value in settings.items():
                await driver.execute(f"SET LOCAL {setting} = '{value}'")
            plans.clear()
            await conn.execute(statements()["claim"].clause, params)
            claimed = await conn.scalars(text(CLAIMED_SQL), {"owner": OWNER})
            agents = tuple(str(agent) for agent in claimed)
            # The driver hands notices to listeners on the loop: by now every plan of the
            # claim has arrived (the read above came back after them).
            ran = [plan for plan in plans if "lease_owner = $1" not in plan.query]
        finally:
            # The claim ran: undo it, so every measurement sees the same queue.
            await transaction.rollback()
    outer = [p for p in ran if "FROM turnstile_claim(" in p.query]
    assert outer, "auto_explain logged no plan of the claim statement"
    plan: PlanNode = {"Node Type": "Result", "Plans": [p.plan for p in ran]}
    return Figure(
        eligibility=eligibility.name,
        classes=eligibility.classes,
        scenario=scenario,
        size=size,
        statement=statement,
        planning=planning,
        buffers=outer[-1].buffers,
        search_buffers=sum(shared_buffers(node) for node in claim_search(plan)),
        execution_ms=float(outer[-1].plan.get("Actual Total Time", 0.0)),
        plan=plan,
        claimed=agents,
        expected=expected_claims(eligibility, scenario, statement),
    )


def layout_of(eligibility: EligibilitySet, scenario: str) -> str:
    if scenario == "other":
        assert eligibility.backlog is not None
        return f"backlog:{eligibility.backlog.value}"
    return "backed-off"


def measurements() -> Iterator[tuple[EligibilitySet, str, str, str]]:
    for eligibility in SETS:
        for scenario in SCENARIOS:
            if scenario == "other" and eligibility.backlog is None:
                continue  # no other class exists; see SETS
            for statement in STATEMENTS:
                for planning in PLANNINGS:
                    yield eligibility, scenario, statement, planning


async def measure_all(server: str, template: str) -> list[Figure]:
    layouts = sorted({layout_of(e, s) for e, s, _, _ in measurements()})
    settings = Settings(database_url=None)
    urls: dict[tuple[str, int], str] = {}
    engines: dict[tuple[str, int], AsyncEngine] = {}
    try:
        for layout in layouts:
            for size in (SMALL, LARGE):
                urls[layout, size] = await clone_database(server, template)
                engines[layout, size] = create_engine(settings, urls[layout, size], pool_size=1)
        # Building the databases is most of this module's time; they are independent, so the
        # server builds them side by side.
        await asyncio.gather(*(populate(engines[key], key[0], key[1]) for key in engines))
        figures = []
        for eligibility, scenario, statement, planning in measurements():
            for size in (SMALL, LARGE):
                engine = engines[layout_of(eligibility, scenario), size]
                figures.append(
                    await measure(engine, eligibility, scenario, size, statement, planning)
                )
        return figures
    finally:
        for engine in engines.values():
            await engine.dispose()
        for url in urls.values():
            await drop_database(server, url)


def report(figures: list[Figure]) -> str:
    lines = [
        f"{'set':<24} {'scenario':<14} {'statement':<10} {'planning':<12} {'size':>7} "
        f"{'buffers':>7} {'search':>6} {'ms':>6}  plan"
    ]
    lines += [
        f"{f.eligibility:<24} {f.scenario:<14} {f.statement:<10} {f.planning:<12} {f.size:>7} "
        f"{f.buffers:>7} {f.search_buffers:>6} {f.execution_ms:>6.2f}  {plan_shape(f)}"
        for f in figures
    ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def figures(server_url: str, template_database: str) -> list[Figure]:
    # Measured once for the module (about half a million rows to build), then asserted per
    # eligibility set. A synchronous fixture with its own event loop, like the session fixtures
    # in conftest, because the test loop is per function.
    measured = asyncio.run(measure_all(server_url, template_database))
    print("\n" + report(measured))
    return measured


def figures_of(figures: list[Figure], eligibility: EligibilitySet) -> list[Figure]:
    mine = [f for f in figures if f.eligibility == eligibility.name]
    assert mine, f"nothing measured for {eligibility.name}"
    return mine


@pytest.mark.parametrize("eligibility", SETS, ids=[s.name for s in SETS])
def test_claim_neither_scans_nor_sorts_the_queue(
    figures: list[Figure], eligibility: EligibilitySet
) -> None:
    for figure in figures_of(figures, eligibility):
        where = f"{figure.statement} ({figure.planning}) {figure.scenario} {figure.size}"
        found = scans_and_sorts(figure)
        bad = [node for node in found if not small_table_choice(figure, node)]
        assert not bad, f"{where}: {json.dumps(bad, indent=1)}"
        if found:
            continue  # claim_many's small-table plan on the 1k table, see small_table_choice
        # Why there is nothing to sort: the candidates come from the claim index, with both the
        # class and the eligibility bound as index conditions, so each priority is one bounded
        # range, read in the index's order, that ends before the backed-off runs.
        for search in claim_search(figure.plan):
            assert search["Node Type"] in ("Index Scan", "Index Only Scan"), where
            # With the one tenant of these databases, ix_runs_claim (priority, eligibility)
            # is as selective as ix_runs_tenant_claim and smaller, and the planner may take it
            # with the tenant as a filter; with many tenants it takes the tenant's index (the
            # bench's depth phase measures 1,000 tenants: docs/adr/0006).
            assert search["Index Name"] in ("ix_runs_tenant_claim", "ix_runs_claim"), where
            conditions = search["Index Cond"] + search.get("Filter", "")
            assert "tenant_id =" in conditions, where
            assert "priority =" in search["Index Cond"], where
            assert "COALESCE(scheduled_for, created_at) <=" in search["Index Cond"], where


@pytest.mark.parametrize("eligibility", SETS, ids=[s.name for s in SETS])
def test_claim_cost_does_not_grow_with_the_queue(
    figures: list[Figure], eligibility: EligibilitySet
) -> None:
    mine = figures_of(figures, eligibility)
    for scenario in SCENARIOS:
        for statement in STATEMENTS:
            for planning in PLANNINGS:
                pair = {
                    f.size: f
                    for f in mine
                    if (f.scenario, f.statement, f.planning) == (scenario, statement, planning)
                }
                if not pair:
                    continue  # scenario "other" of the set of all classes; see SETS
                small, large = pair[SMALL], pair[LARGE]
                # A hundred times the runs may cost a deeper index (one more level per
                # descent), never a walk over them.
                assert large.buffers <= 2 * small.buffers, (
                    f"{statement} {scenario} ({planning}): {small.buffers} buffers at {SMALL} "
                    f"runs, {large.buffers} at {LARGE}\n{json.dumps(large.plan, indent=1)}"
                )


@pytest.mark.parametrize("eligibility", SETS, ids=[s.name for s in SETS])
def test_claim_takes_the_head_of_its_classes(
    figures: list[Figure], eligibility: EligibilitySet
) -> None:
    for figure in figures_of(figures, eligibility):
        where = f"{figure.statement} ({figure.planning}) {figure.scenario} {figure.size}"
        if figure.statement == "claim_one" and figure.scenario != "none-eligible":
            assert len(figure.claimed) == 1, where
        assert figure.claimed == figure.expected, where
