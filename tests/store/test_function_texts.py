"""The store holds the live text of every function the database runs (app/store/functions/).

Migrations install frozen copies (alembic/frozen/), so the two could drift apart: these tests
hold a database migrated to head against the store's files. Each file, executed on that
database, must leave every function exactly as it was (same definitions, no overload added),
and every function of ours in the database must have its file.
"""

from __future__ import annotations

from importlib import resources

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

FUNCTIONS = resources.files("app.store").joinpath("functions")
FILES = sorted(p.name for p in FUNCTIONS.iterdir() if p.name.endswith(".sql"))

DEFINITIONS = text(
    "SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid) "
    "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
    "WHERE n.nspname = 'public' AND p.proname LIKE 'turnstile%' ORDER BY 1, 2"
)


async def _definitions(engine: AsyncEngine) -> list[tuple[str, str, str]]:
    async with engine.connect() as conn:
        return [(str(a), str(b), str(c)) for a, b, c in (await conn.execute(DEFINITIONS)).all()]


@pytest.mark.parametrize("name", FILES)
async def test_each_function_file_is_the_function_at_head(engine: AsyncEngine, name: str) -> None:
    before = await _definitions(engine)
    source = FUNCTIONS.joinpath(name).read_text(encoding="utf-8")
    async with engine.connect() as conn:
        transaction = await conn.begin()
        await conn.exec_driver_sql(source)
        after = [(str(a), str(b), str(c)) for a, b, c in (await conn.execute(DEFINITIONS)).all()]
        await transaction.rollback()
    assert after == before, f"app/store/functions/{name} differs from the migrated function"


async def test_every_function_at_head_has_its_file(engine: AsyncEngine) -> None:
    names = {name for name, _, _ in await _definitions(engine)}
    files = {name.removesuffix(".sql") for name in FILES}
    assert names == files
