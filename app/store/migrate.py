"""Schema migrations: run Alembic programmatically and tell which revision the code expects.

`upgrade()` is synchronous because Alembic's async env runs its own event loop; async callers
run it in a thread (`await asyncio.to_thread(upgrade, url)`) so Alembic's loop never meets
theirs.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from alembic import command

# Arbitrary but fixed: the key of the advisory lock every migrating process takes first.
MIGRATION_LOCK_KEY = 0x7475726E  # "turn"


def migrations_root() -> Path:
    """Where alembic.ini and alembic/ are: inside the installed package (a wheel carries a copy
    in app/migrations/, see setup.py), else beside the package in a source checkout (the top
    of the repository, where they are kept), else the working directory."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "migrations", package.parent, Path.cwd()):
        if (candidate / "alembic.ini").is_file() and (candidate / "alembic").is_dir():
            return candidate
    raise FileNotFoundError(
        "alembic.ini and alembic/ not found in the package, beside it, or in this folder"
    )


def alembic_config(url: str | None = None, *, pgbouncer: bool = False) -> Config:
    root = migrations_root()
    config = Config(str(root / "alembic.ini"))
    config.set_main_option("script_location", str(root / "alembic"))
    if url is not None:
        config.attributes["database_url"] = url
    config.attributes["pgbouncer"] = pgbouncer
    return config


def frozen(revision: str, function: str) -> str:
    """The text of `function` as migration `revision` installed it: alembic/frozen/ holds one
    file per (revision, function), written once and never changed, so a migration replays
    exactly what it first ran whatever the store's current text (app/store/functions/)."""
    path = migrations_root() / "alembic" / "frozen" / f"{revision}-{function}.sql"
    return path.read_text(encoding="utf-8")


LOCK_WAIT = "500ms"
"""How long `lock_up_front` waits for its locks in one try: below PostgreSQL's default
deadlock_timeout (1 s), so when an older release's statement holds one of the tables while it
waits for another this migration took, this migration gives way (and tries again) before the
deadlock detector can pick the migration as its victim."""
LOCK_TRIES = 120


def lock_up_front(connection: Connection, *locks: str) -> None:
    """Take every lock a migration's changes will need before it changes anything, in one
    savepoint: each of `locks` is a `LOCK TABLE ... IN ... MODE` statement. When they are not
    all granted within `LOCK_WAIT`, the savepoint gives back what it took, and it tries again
    after a pause (an old release's transactions finish meanwhile). Taken one by one across the
    migration, the same locks deadlock with a running older release's claim (it reads one
    table, the migration alters it, each then waits for the other)."""
    for attempt in range(LOCK_TRIES):
        savepoint = connection.begin_nested()
        try:
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
            for lock in locks:
                connection.exec_driver_sql(lock)
            connection.exec_driver_sql("SET LOCAL lock_timeout TO DEFAULT")
        except DBAPIError as exc:
            savepoint.rollback()
            code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
            if code != "55P03" or attempt == LOCK_TRIES - 1:  # lock_not_available
                raise
            time.sleep(min(0.05 * (attempt + 1), 1.0))
            continue
        savepoint.commit()  # released: the locks stay with the migration's transaction
        return


def upgrade(url: str, revision: str = "head", *, pgbouncer: bool = False) -> None:
    command.upgrade(alembic_config(url, pgbouncer=pgbouncer), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


@lru_cache(maxsize=1)
def known_revisions() -> frozenset[str]:
    """Every revision this code's migrations know."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(revision.revision for revision in script.walk_revisions())


@lru_cache(maxsize=1)
def head_revision() -> str:
    """The newest revision this code knows; /readyz compares the database's with it."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migrations found"
    return head


def database_url_for_alembic() -> str:
    """The URL plain `alembic` commands use: DATABASE_URL, or the embedded server."""
    from app.config import get_settings
    from app.store.embedded import start_embedded

    settings = get_settings()
    if settings.database_url:
        return settings.database_url
    return start_embedded(settings.data_dir).url
