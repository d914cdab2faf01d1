"""Schema migrations: run Alembic programmatically and tell which revision the code expects.

`upgrade()` is synchronous because Alembic's async env runs its own event loop; async callers
run it in a thread (`await asyncio.to_thread(upgrade, url)`) so Alembic's loop never meets
theirs.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory

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


def upgrade(url: str, revision: str = "head", *, pgbouncer: bool = False) -> None:
    command.upgrade(alembic_config(url, pgbouncer=pgbouncer), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


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
