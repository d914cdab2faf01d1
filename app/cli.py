"""The `turnstile` command line: serve, migrate, and (as they land) the operator commands.

Thin by design: each command parses its flags, calls into the app, and prints one line on
error (exit status 2) rather than a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from app.config import Settings
from app.db.embedded import EmbeddedUnavailableError


class CommandError(Exception):
    """A failure to report as one line on stderr."""


def _settings(**overrides: object) -> Settings:
    try:
        settings = Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        raise CommandError(f"invalid setting {where}: {first['msg']}") from None
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


def _migrated_settings(settings: Settings) -> Settings:
    """Resolve the database (starting the embedded one if needed) and migrate it to head."""
    from app.db.migrate import head_revision, upgrade
    from app.db.state import resolve_database

    database = resolve_database(settings)
    upgrade(database.url)
    where = (
        f"embedded PostgreSQL ({database.embedded.kind}) in {database.embedded.data_dir}"
        if database.embedded
        else "DATABASE_URL"
    )
    print(f"turnstile: schema at revision {head_revision()} on {where}", file=sys.stderr)
    return settings.model_copy(update={"database_url": database.url})


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.main import create_app

    settings = _migrated_settings(_settings(host=args.host, port=args.port))
    app = create_app(settings)
    print(f"turnstile: serving on http://{settings.host}:{settings.port}/docs", file=sys.stderr)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


def cmd_migrate(args: argparse.Namespace) -> None:
    _migrated_settings(_settings())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the API (and its worker pool)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8000)")
    serve.set_defaults(func=cmd_serve)

    migrate = sub.add_parser("migrate", help="upgrade the database schema to this version")
    migrate.set_defaults(func=cmd_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except (CommandError, EmbeddedUnavailableError) as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
