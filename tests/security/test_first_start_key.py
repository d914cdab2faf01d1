"""The first-start development key: made only on the embedded database, written to a file only
its owner can read in the embedded data folder, and never printed; a `serve` against a
configured DATABASE_URL (production) makes no key at all and logs none."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli import first_start_key
from app.config import Settings
from app.security.api_keys import KEY_PREFIX, authenticate
from app.store.embedded import EmbeddedDatabase, free_port
from tests.support.processes import turnstile


async def key_count(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM api_keys"))).scalar_one())


async def test_serve_with_database_url_makes_and_logs_no_key(
    database_url: str, engine: AsyncEngine
) -> None:
    port = free_port()
    env = {"DATABASE_URL": database_url, "TURNSTILE_RUN_WORKERS": "false"}
    async with turnstile("serve", "--port", str(port), ready=b"Uvicorn running", env=env) as child:
        assert await key_count(engine) == 0
    log = child.log.decode()
    assert KEY_PREFIX not in log, log
    assert "turnstile keys create" in log  # says how to make one instead


async def test_the_embedded_database_gets_a_key_in_a_private_file(
    database_url: str, engine: AsyncEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The embedded server stands in for itself here: the same code path, with its data folder
    # in tmp_path and the test's database behind it.
    embedded = EmbeddedDatabase(url=database_url, kind="pgserver", data_dir=tmp_path)
    await first_start_key(Settings(database_url=database_url), embedded)
    path = tmp_path / "dev-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    caller = await authenticate(engine, secret)
    assert caller is not None
    assert (caller.tenant_id, caller.scopes) == ("dev", frozenset({"operator"}))
    printed = capsys.readouterr()
    assert secret not in printed.out + printed.err
    assert str(path) in printed.err

    # Keys exist now: a second start makes none and leaves the file alone.
    await first_start_key(Settings(database_url=database_url), embedded)
    assert await key_count(engine) == 1
    assert path.read_text().strip() == secret
