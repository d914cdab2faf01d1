"""Loads the named statements of `queries.sql` once, at first use.

A statement starts at a `-- name: x` line and runs to the next one; a `-- fenced` line among its
leading comments marks it as a worker write under a lease. `{{now}}` expands to the injectable
clock, `coalesce(CAST(:now AS timestamptz), now())`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from sqlalchemy import TextClause, text

NOW = "coalesce(CAST(:now AS timestamptz), now())"
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Statement:
    name: str
    sql: str
    fenced: bool
    clause: TextClause


def parse(source: str) -> dict[str, Statement]:
    statements: dict[str, Statement] = {}
    parts = _NAME.split(source)
    # parts: [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in statements:
            raise ValueError(f"statement {name!r} is defined twice")
        leading = [line.strip() for line in body.strip().splitlines()]
        fenced = False
        for line in leading:
            if not line.startswith("--"):
                break
            fenced = fenced or line == "-- fenced"
        sql = body.strip().replace("{{now}}", NOW).rstrip(";")
        statements[name] = Statement(name=name, sql=sql, fenced=fenced, clause=text(sql))
    return statements


@cache
def load_statements(package: str) -> dict[str, Statement]:
    """The named statements of `package`'s queries.sql, parsed once."""
    source = resources.files(package).joinpath("queries.sql").read_text(encoding="utf-8")
    return parse(source)


def statements() -> dict[str, Statement]:
    return load_statements("app.queue")


def q(name: str) -> TextClause:
    """The named statement, ready to execute."""
    return statements()[name].clause
