"""Named SQL statements: the format every statement of the store is kept in, and their loader.

The statements live in `app/store/sql/`, one file per concern (runs.sql: the transitions of
runs; reads.sql; submission.sql; workers.sql; dashboard.sql; schedules.sql; webhooks.sql;
tenants.sql; deltas.sql; credentials.sql: API keys and dashboard sessions; conversations.sql:
the Responses API's deletions; budgets.sql: model budgets and their reservations). A statement
starts at a `-- name: x` line and runs to the next one; a `-- fenced` line among its leading
comments marks it as a worker write under a lease. `{{now}}` expands to the injectable clock,
`coalesce(CAST(:now AS timestamptz), now())`. A `-- fragment: x` block (up to the next
`-- name:` or `-- fragment:` line) is text shared by several statements, expanded wherever
`{{x}}` appears. Names are unique across the files (the loader refuses a duplicate). Only
app/store executes them (tests/test_architecture.py enforces it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from sqlalchemy import TextClause, text

NOW = "coalesce(CAST(:now AS timestamptz), now())"
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_FRAGMENT = re.compile(
    r"^-- fragment: (\w+)\s*$\n(.*?)(?=^-- name: |^-- fragment: |\Z)", re.M | re.S
)


@dataclass(frozen=True)
class Statement:
    name: str
    sql: str
    fenced: bool
    clause: TextClause
    source: str  # the file it came from


def fragments_of(source: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip() for m in _FRAGMENT.finditer(source)}


def parse(
    source: str, origin: str = "<string>", shared: dict[str, str] | None = None
) -> dict[str, Statement]:
    """The statements of one file; `shared` adds fragments defined in its package's other
    files (a fragment of the file itself wins)."""
    statements: dict[str, Statement] = {}
    fragments = {**(shared or {}), **fragments_of(source)}
    source = _FRAGMENT.sub("", source)
    parts = _NAME.split(source)
    # parts: [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in statements:
            raise ValueError(f"statement {name!r} is defined twice in {origin}")
        leading = [line.strip() for line in body.strip().splitlines()]
        fenced = False
        for line in leading:
            if not line.startswith("--"):
                break
            fenced = fenced or line == "-- fenced"
        sql = body.strip()
        for fragment, text_ in fragments.items():
            sql = sql.replace("{{" + fragment + "}}", text_)
        sql = sql.replace("{{now}}", NOW).rstrip(";")
        statements[name] = Statement(
            name=name, sql=sql, fenced=fenced, clause=text(sql), source=origin
        )
    return statements


FILES = (
    "runs.sql",
    "reads.sql",
    "submission.sql",
    "workers.sql",
    "dashboard.sql",
    "schedules.sql",
    "webhooks.sql",
    "tenants.sql",
    "deltas.sql",
    "credentials.sql",
    "conversations.sql",
    "budgets.sql",
)


@cache
def load_statements(files: tuple[str, ...] = FILES) -> dict[str, Statement]:
    """The named statements of `files` (in app/store/sql/), parsed once; a name defined in two
    files is refused."""
    merged: dict[str, Statement] = {}
    folder = resources.files("app.store").joinpath("sql")
    sources = {
        filename: folder.joinpath(filename).read_text(encoding="utf-8") for filename in files
    }
    shared: dict[str, str] = {}
    for source in sources.values():
        shared.update(fragments_of(source))
    for filename, source in sources.items():
        for name, statement in parse(source, f"app/store/sql/{filename}", shared).items():
            if name in merged:
                raise ValueError(
                    f"statement {name!r} is defined in {merged[name].source} and {statement.source}"
                )
            merged[name] = statement
    return merged


def statements() -> dict[str, Statement]:
    """Every named statement of the store."""
    return load_statements()


def q(name: str) -> TextClause:
    """The named statement, ready to execute."""
    return statements()[name].clause
