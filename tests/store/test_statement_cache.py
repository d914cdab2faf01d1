"""The driver prepares each named statement once per connection, however long it is.

asyncpg keeps a prepared statement in its cache only when its text is at most
`max_cacheable_statement_size` (15 KiB by default); a longer one is parsed and planned by the
server on every call. `end_holds`, the one statement that ends every hold, is longer than
that: with the driver's default, every completion batch was prepared again, which cost the
worker and PostgreSQL a third more CPU per run (issue 32's regression)."""

from __future__ import annotations

import uuid

from app.config import Settings
from app.queue.core import Queue
from app.store.database import positional
from app.store.engine import STATEMENT_CACHE_MAX_BYTES, create_engine
from app.store.statements import statements
from app.vocabulary.records import Fenced, HoldEnd, Lease

DRIVER_DEFAULT_BYTES = 15 * 1024


def test_every_named_statement_fits_the_driver_cache() -> None:
    sizes = {name: len(positional(name)[0].encode()) for name in statements()}
    too_long = {name: size for name, size in sizes.items() if size > STATEMENT_CACHE_MAX_BYTES}
    assert not too_long
    # The case this guards: a statement past the driver's own default.
    assert sizes["end_holds"] > DRIVER_DEFAULT_BYTES


async def test_end_holds_is_prepared_once_per_connection(
    settings: Settings, database_url: str
) -> None:
    engine = create_engine(settings, database_url, pool_size=1)
    try:
        queue = Queue(engine)
        lease = Lease(run_id=uuid.uuid4(), epoch=1, owner="w-test")
        for _ in range(3):
            # No such run: fenced, nothing written, the statement sent all the same.
            outcomes = await queue.end_holds([HoldEnd.succeeded(lease, {"ok": True})])
            assert outcomes == [Fenced(lease)]
        sql, _ = positional("end_holds")
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            prepared = await raw.driver_connection.fetchval(
                "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", sql
            )
        # One server-side prepared statement, reused by every call on this connection.
        assert prepared == 1
    finally:
        await engine.dispose()
