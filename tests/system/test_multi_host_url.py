"""A multi-host DATABASE_URL (libpq's `host1:port1,host2:port2` with
`target_session_attrs=read-write`) reaches the primary wherever it is, for the pool, the
migrations and the LISTEN connection, and a standby's answers are what a failover makes them:
not-committed errors (the API's 503), never a bare failure (issue 36).

The servers are a pg_auto_failover cluster of this module's own (tests/support/ha_cluster.py):
a primary and its synchronous standby, the URLs naming the standby first so that finding the
primary is the URL's work, not the luck of the order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest
from sqlalchemy.exc import OperationalError

from app.config import Settings
from app.queue.core import Queue
from app.security.api_keys import create_key
from app.store.embedded import LocalCluster
from app.store.engine import (
    DatabaseUrlError,
    async_url,
    connect_timeout,
    create_engine,
    hosts_of,
    plain_url,
)
from app.store.migrate import upgrade
from app.store.outcomes import NotCommitted
from app.store.primary import primary_answers
from app.vocabulary.records import NewRun
from app.worker.notifier import Notifier
from tests.support.api import running_api
from tests.support.ha_cluster import AutoFailoverCluster, Node, start_cluster
from tests.support.processes import run_cli

pytestmark = pytest.mark.timeout(300)


def test_the_libpq_multi_host_spelling_is_translated_both_ways() -> None:
    url = "postgresql://u:p%40ss@h1:5001,h2:5002/db?connect_timeout=3&application_name=x"
    parsed = async_url(url)
    assert parsed.drivername == "postgresql+asyncpg"
    assert parsed.query["host"] == ("h1:5001", "h2:5002")
    # Every process writes: a multi-host URL without it asks for the primary.
    assert parsed.query["target_session_attrs"] == "read-write"
    # asyncpg takes the timeout as an argument, not as a server setting.
    assert "connect_timeout" not in parsed.query
    assert connect_timeout(url) == 3.0
    assert hosts_of(url) == ["h1:5001", "h2:5002"]
    # The plain spelling names every host where asyncpg reads them all (it keeps only the
    # last of repeated `host` parameters), the password kept as it was written.
    assert plain_url(url) == (
        "postgresql://u:p%40ss@h1:5001,h2:5002/db?application_name=x"
        "&target_session_attrs=read-write"
    )
    # SQLAlchemy's spelling is rendered for asyncpg the same way, read-write included.
    assert plain_url("postgresql+asyncpg://u@/db?host=h1:1&host=h2:2&application_name=a@b") == (
        "postgresql://u@h1:1,h2:2/db?application_name=a%40b&target_session_attrs=read-write"
    )
    assert plain_url("postgresql://h1:1,h2:2/db") == (
        "postgresql://h1:1,h2:2/db?target_session_attrs=read-write"
    )
    with pytest.raises(DatabaseUrlError, match="connect_timeout"):
        connect_timeout("postgresql://u@h/db?connect_timeout=soon")
    with pytest.raises(DatabaseUrlError, match="no number"):
        async_url("postgresql://u@h1:x,h2:2/db")
    assert hosts_of("postgresql://u@[::1]:5432,[::2]/db") == ["[::1]:5432", "[::2]"]
    chosen = "postgresql://u@h1,h2/db?target_session_attrs=primary"
    assert async_url(chosen).query["target_session_attrs"] == "primary"
    # One host: unchanged, as before.
    assert plain_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert hosts_of("postgresql://u@h/db") == []


async def test_migrate_refuses_a_broken_multi_host_url_in_one_line() -> None:
    status, _out, err = await run_cli(
        "migrate", env={"DATABASE_URL": "postgresql://u@127.0.0.1:x,127.0.0.1:2/db"}
    )
    assert status == 2
    assert err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    assert "no number" in err


@pytest.fixture(scope="module")
def ha() -> Iterator[AutoFailoverCluster]:
    cluster = asyncio.run(start_cluster())
    try:
        upgrade(cluster.url())
        yield cluster
    finally:
        cluster.stop()


def standby_first(ha: AutoFailoverCluster, **query: str) -> str:
    """The multi-host URL with the standby first: only the primary takes writes."""
    primary = ha.primary()
    assert primary is not None
    nodes = sorted(ha.nodes, key=lambda n: n is primary)
    hosts = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    params = "&".join(f"{k}={v}" for k, v in {"connect_timeout": "3", **query}.items())
    return f"postgresql://postgres@{hosts}/postgres?{params}"


def only(node: Node, **query: str) -> str:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"postgresql://postgres@127.0.0.1:{node.port}/postgres?{params}"


def standby(ha: AutoFailoverCluster) -> Node:
    return next(n for n in ha.nodes if n is not ha.primary())


@pytest.fixture
async def queue(ha: AutoFailoverCluster) -> AsyncIterator[Queue]:
    engine = create_engine(Settings(), standby_first(ha))
    yield Queue(engine)
    await engine.dispose()


def new_run(tag: str) -> NewRun:
    return NewRun(tenant_id="t", principal="p", agent="scripted", input={"tag": tag})


async def test_migrate_takes_a_multi_host_url(ha: AutoFailoverCluster) -> None:
    ha.psql(ha.primary().port, "CREATE DATABASE migrated")  # type: ignore[union-attr]
    url = standby_first(ha).replace("/postgres?", "/migrated?")
    status, _out, err = await run_cli("migrate", env={"DATABASE_URL": url})
    assert status == 0, err
    assert "Traceback" not in err
    found = ha.psql(ha.primary().port, "SELECT version_num FROM alembic_version", "migrated")  # type: ignore[union-attr]
    assert found


async def test_the_pool_writes_on_the_primary_whichever_host_comes_first(queue: Queue) -> None:
    run = await queue.enqueue(new_run("first"))
    assert await queue.get_run(run.id) is not None
    assert await primary_answers(queue.db.engine)


async def test_the_listen_connection_finds_the_primary(
    ha: AutoFailoverCluster, queue: Queue
) -> None:
    notifier = Notifier(standby_first(ha))
    woken: list[set[int] | None] = []
    notifier.on_work(woken.append)
    await notifier.start()
    try:
        await asyncio.wait_for(notifier.connected.wait(), 20)
        woken.clear()  # the wake-up of every new connection
        await queue.enqueue(new_run("notified"))
        for _ in range(200):
            if any(w for w in woken):
                break
            await asyncio.sleep(0.05)
        assert any(w for w in woken), woken
    finally:
        await notifier.stop()


async def test_a_standby_refuses_writes_as_not_committed(ha: AutoFailoverCluster) -> None:
    """A session on a standby (an old primary come back as one): its write refused is not
    committed, the connection dropped from the pool (it would refuse every write after)."""
    engine = create_engine(Settings(), only(standby(ha)))
    try:
        queue = Queue(engine)
        with pytest.raises(NotCommitted):
            await queue.enqueue(new_run("on the standby"))
        assert not await primary_answers(engine)
    finally:
        await engine.dispose()


async def test_no_host_taking_writes_is_an_operational_error(ha: AutoFailoverCluster) -> None:
    """Only standbys answer (a failover under way): asyncpg's TargetServerAttributeNotMatched,
    raised as it is by SQLAlchemy's pool, becomes an OperationalError on every path."""
    engine = create_engine(Settings(), only(standby(ha), target_session_attrs="read-write"))
    try:
        with pytest.raises(OperationalError):
            await Queue(engine).enqueue(new_run("nowhere"))
        with pytest.raises(OperationalError):
            async with engine.connect():
                pass
    finally:
        await engine.dispose()
    with pytest.raises(asyncpg.TargetServerAttributeNotMatched):
        await asyncpg.connect(plain_url(only(standby(ha), target_session_attrs="read-write")))


async def test_the_api_on_a_standby_answers_503_and_is_not_ready(
    ha: AutoFailoverCluster, queue: Queue
) -> None:
    """An API whose URL names a standby only (what a failover leaves a single-host URL with):
    not ready, and a submission answered 503 problem+json with Retry-After, not a bare 500."""
    secret = (await create_key(queue.db.engine, tenant_id="acme", principal="svc")).secret
    url = only(standby(ha))
    engine = create_engine(Settings(), url)
    try:
        async with (
            running_api(url, engine) as api,
            httpx.AsyncClient(base_url=api.base, timeout=30) as client,
        ):
            ready = await client.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert "read-only" in ready.json()["checks"]["database"]
            response = await client.post(
                "/runs",
                json={"input": {"tag": "refused"}},
                headers={"Authorization": f"Bearer {secret}", "Idempotency-Key": "k1"},
            )
            assert response.status_code == 503, response.text
            assert response.headers["content-type"] == "application/problem+json"
            assert response.headers["retry-after"]
            assert response.json()["type"].endswith("database-unavailable")
    finally:
        await engine.dispose()


async def test_the_api_on_the_multi_host_url_is_ready(ha: AutoFailoverCluster) -> None:
    url = standby_first(ha)
    engine = create_engine(Settings(), url)
    try:
        async with (
            running_api(url, engine) as api,
            httpx.AsyncClient(base_url=api.base, timeout=30) as client,
        ):
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert json.loads(ready.text)["checks"]["database"] == "ok"
    finally:
        await engine.dispose()


async def test_a_patient_engine_waits_for_its_database_to_come_back(
    throwaway_cluster: LocalCluster,
) -> None:
    """A worker's engine (`connect_patience_seconds`) waits for a primary instead of failing
    the write that needed a connection: the connection is made once the server is back."""
    url = throwaway_cluster.url()
    await asyncio.to_thread(throwaway_cluster.stop, "fast")
    engine = create_engine(Settings(), url, connect_patience_seconds=120)
    impatient = create_engine(Settings(), url)
    try:
        with pytest.raises((OperationalError, OSError)):
            async with impatient.connect():
                pass
        # Refused until the server is up: pg_ctl takes a while, the attempts go on meanwhile.
        waiting = asyncio.create_task(primary_answers(engine))
        await asyncio.to_thread(throwaway_cluster.start)
        assert await asyncio.wait_for(waiting, 120)
    finally:
        await engine.dispose()
        await impatient.dispose()
