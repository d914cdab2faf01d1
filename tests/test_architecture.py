"""The import contract: which package may import which (docs/architecture.md).

- The queue core (app/queue) imports none of the edges or the layers above it: api, ui,
  runtime, worker, maintenance, cli, nor the settings (the app factory builds its services).
- The runtime imports no api; the api imports no worker.
- The Python client (clients/python, the `turnstile-client` distribution) imports nothing of the
  server's `app` package.
- app/installation.py (the CLI's first check of the installed package) imports nothing of `app`.
- Observability (metrics, logs, traces) is a leaf every layer may call: it imports none of the
  layers that call it. Only app/observability/tracing.py imports OpenTelemetry (the optional
  `turnstile[otel]` extra), and only inside functions, so nothing of it loads while tracing is
  off.
- Only the store loads named statements (app.store.statements); api, ui, cli, worker,
  runtime and maintenance import no statement loader: they call typed services.

The house rules (issue 32):
- Only app/store runs statements: outside it no module loads named statements, imports the
  driver (asyncpg) or SQLAlchemy's statement building (its errors, the engine as a handle and
  `RowMapping` only), calls `text(...)`, sends a statement (`execute`, `fetch*`, `stream`, ...
  on a connection or an engine) or opens a connection on an engine. `RUNS_SQL_OUTSIDE_THE_STORE`
  lists the modules still in transition, each with its reason; an entry that no longer needs
  its place fails.
- No package cycle: the packages of `app` (app.cli, app.config... count as packages) import
  each other in one direction only.
- No module name is used twice in app/ (`NAMES_USED_TWICE`: the ones still in transition).
- No function text exists only in a migration: every function a migration creates has its live
  file in app/store/functions/, migrations hold no CREATE FUNCTION of their own (they install
  alembic/frozen/ copies), and the newest frozen copy of each function is its live file
  (tests/store/test_function_texts.py holds the migrated database against the same files).

Every `import` counts, at module level or inside a function. A failure names the module, the
line and the import.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"
LOADERS = ("app.store.statements",)
EDGES = (
    "app.api",
    "app.ui",
    "app.cli",
    "app.roles",
    "app.worker",
    "app.runtime",
    "app.maintenance",
)

# (importing package, forbidden prefixes)
RULES: list[tuple[str, tuple[str, ...]]] = [
    (
        "app.queue",
        (
            "app.api",
            "app.ui",
            "app.runtime",
            "app.worker",
            "app.maintenance",
            "app.cli",
            "app.main",
            # The app factory builds the core's services from the settings; the core takes
            # plain values, so it never reaches the settings (nor, through them, the edges).
            "app.config",
        ),
    ),
    ("app.runtime", ("app.api",)),
    (
        "app.observability",
        (
            "app.api",
            "app.ui",
            "app.runtime",
            "app.worker",
            "app.maintenance",
            "app.cli",
            "app.roles",
            "app.main",
            "app.store",
        ),
    ),
    ("app.api", ("app.worker",)),
    # Other APIs' wire protocols are pure mappings: no HTTP edge, no core, no store.
    (
        "app.protocols",
        ("app.api", "app.ui", "app.queue", "app.store", "app.runtime", "app.worker", "app.main"),
    ),
    # The CLI's first check, before anything of the installed `app` package is trusted.
    ("app.installation", ("app",)),
    *[(edge, LOADERS) for edge in EDGES],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_in(
        path.read_text(encoding="utf-8"), module_name(path), package=path.name == "__init__.py"
    )


def imports_in(source: str, name: str, *, package: bool = False) -> list[tuple[int, str]]:
    """The modules `source` (module `name`) imports, relative imports resolved."""
    tree = ast.parse(source)
    # The package a relative import counts from: the module's own for an __init__.py.
    parts = name.split(".") if package else name.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.append((node.lineno, module))
            # `from app.queue import sql` imports the module app.store.statements.
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


MODULES = sorted(APP.rglob("*.py"))
CLIENT = ROOT / "clients" / "python"
CLIENT_MODULES = sorted(CLIENT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_follow_the_contract(path: Path) -> None:
    importer = module_name(path)
    broken = [
        f"{path.relative_to(ROOT)}:{line}: {importer} imports {imported} "
        f"({package} may not import {forbidden})"
        for package, banned in RULES
        if within(importer, package)
        for line, imported in imports_of(path)
        for forbidden in banned
        if within(imported, forbidden)
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_the_store_and_its_callers_in_transition_load_statements(path: Path) -> None:
    importer = module_name(path)
    if any(within(importer, owner) for owner in ("app.store", "app.queue.core")):
        return
    broken = [
        f"{path.relative_to(ROOT)}:{line}: {importer} imports {imported}"
        for line, imported in imports_of(path)
        if within(imported, "app.store.statements")
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", CLIENT_MODULES, ids=lambda p: str(p.relative_to(CLIENT)))
def test_the_python_client_imports_nothing_of_the_server(path: Path) -> None:
    """The client is a distribution of its own for programs that only call the API: nothing of
    `app`, so it costs httpx and httpx-sse alone (tests/clients/test_python_client.py checks the
    modules it loads) and a program with its own `app` package can use it."""
    source = path.read_text(encoding="utf-8")
    broken = [
        f"{path.relative_to(ROOT)}:{line}: imports {imported}"
        for line, imported in imports_in(source, "turnstile_client.module")
        if within(imported, "app")
    ]
    assert not broken, "\n".join(broken)


def test_the_contract_sees_the_python_client() -> None:
    assert {p.name for p in CLIENT_MODULES} >= {"__init__.py", "aio.py", "blocking.py"}


def test_relative_imports_are_resolved() -> None:
    found = {m for _, m in imports_in("from .sql import q\nfrom .. import config\n", "app.api.x")}
    assert found == {"app.api.sql", "app.api.sql.q", "app", "app.config"}
    inside = {m for _, m in imports_in("from . import sql\n", "app.queue", package=True)}
    assert inside == {"app.queue", "app.queue.sql"}


def test_the_contract_sees_every_package() -> None:
    packages = {module_name(p).split(".")[1] for p in MODULES if module_name(p) != "app"}
    assert {"api", "ui", "queue", "runtime", "worker", "maintenance", "security"} <= packages


def test_the_runtime_writes_only_through_its_execution() -> None:
    """The runtime reaches the queue only through `ExecutionContext`'s fenced writes, never
    through the queue object the context carries (any `.queue` attribute in the runtime's
    code is refused)."""
    offending = [
        f"{path.relative_to(ROOT)}:{node.lineno}: .queue"
        for path in sorted((APP / "runtime").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "queue"
    ]
    assert not offending, "\n".join(offending)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_tracing_imports_opentelemetry_and_only_when_on(path: Path) -> None:
    """OpenTelemetry is optional: one module may import it, and never at module level (the
    hooks are no-ops, importing nothing, until the OTEL_* settings turn tracing on)."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # Imports under `if TYPE_CHECKING:` are for the type checker only.
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    module_level = {id(node) for node in tree.body}
    broken = [
        f"{path.relative_to(ROOT)}:{line}: {importer} imports {imported}"
        + (" at module level" if importer == "app.observability.tracing" else "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in typing_only
        for line, imported in imports_in(ast.unparse(node), importer)
        if within(imported, "opentelemetry")
        and (importer != "app.observability.tracing" or id(node) in module_level)
    ]
    assert not broken, "\n".join(broken)


# --- The house rules of issue 32: one home for the database, no cycles, unique names. ---

STORE = "app.store"

SQL_CALLS = frozenset(
    {"execute", "executemany", "exec_driver_sql", "fetch", "fetchrow", "fetchval", "stream"}
)
"""Methods that send a statement, on a connection, an engine or a driver connection."""

SQL_IMPORTS_ALLOWED = (
    # The engine is a handle the app factory builds and hands to the store's services; its
    # errors are mapped to problems, exit codes and readiness; a row's type is a type.
    "sqlalchemy.exc",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.ext.asyncio.AsyncEngine",
    "sqlalchemy.ext.asyncio.AsyncConnection",
    "sqlalchemy.RowMapping",
)

RUNS_SQL_OUTSIDE_THE_STORE: dict[str, str] = {
    # module: why it still sends statements itself (each entry must still need its place:
    # test_the_allow_list_of_statements_outside_the_store_is_current).
    "app/queue/core.py": "the sweep's lock-then-end transaction (lock_expired, end_holds) and "
    "the statement names `Queue` hands to the store's `Database`; moved with the core's rework",
    "app/worker/notifier.py": "the worker's dedicated LISTEN connection (asyncpg, a keepalive "
    "SELECT 1): moved with the worker's rework",
}


def sql_uses(path: Path) -> list[str]:
    """What in `path` runs or builds a statement: a statement loader, the driver, SQLAlchemy's
    statement building, `text(...)`, a call sending a statement, or a connection opened on an
    engine (`engine.begin()`, `engine.connect()`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[str] = []
    for line, imported in imports_of(path):
        if within(imported, "app.store.statements") or within(imported, "asyncpg"):
            found.append(f"{line}: imports {imported}")
    for node in ast.walk(tree):
        # `from sqlalchemy import RowMapping` is judged by what it takes, not by its module.
        taken = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [f"{node.module}.{alias.name}" for alias in node.names]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        found.extend(
            f"{node.lineno}: imports {name}"
            for name in taken
            if within(name, "sqlalchemy")
            and not any(within(name, allowed) for allowed in SQL_IMPORTS_ALLOWED)
        )
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "text":
            found.append(f"{node.lineno}: text(...)")
        elif isinstance(func, ast.Attribute):
            receiver = ast.unparse(func.value)
            if (func.attr in SQL_CALLS and ("conn" in receiver or "engine" in receiver)) or (
                func.attr in ("begin", "connect") and "engine" in receiver
            ):
                found.append(f"{node.lineno}: {receiver}.{func.attr}(...)")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_the_store_runs_statements(path: Path) -> None:
    """Every statement the house sends is the store's (app/store/sql/*.sql through its
    `Database`, app/store/functions/*.sql): the domain packages call the store's typed methods
    and the edges call the domain's services, none of them opens a connection or builds SQL."""
    name = module_name(path)
    if within(name, STORE) or str(path.relative_to(ROOT)) in RUNS_SQL_OUTSIDE_THE_STORE:
        return
    found = sql_uses(path)
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{use}" for use in found)


def test_the_allow_list_of_statements_outside_the_store_is_current() -> None:
    stale = [
        module
        for module in RUNS_SQL_OUTSIDE_THE_STORE
        if not (ROOT / module).exists() or not sql_uses(ROOT / module)
    ]
    assert not stale, f"no longer run statements (drop them from the list): {stale}"


def test_the_statement_rule_sees_what_runs_sql() -> None:
    source = (
        "from sqlalchemy import text\nfrom app.store.statements import q\n"
        "async def f(engine, conn, pool):\n"
        "    async with engine.begin() as c:\n        await c.execute(text('x'))\n"
        "    await conn.fetchval('SELECT 1')\n    await pool.executor.execute(1)\n"
    )
    probe = ROOT / "app" / "queue" / "_probe_.py"
    try:
        probe.write_text(source, encoding="utf-8")
        found = sql_uses(probe)
    finally:
        probe.unlink()
    # text's import, the loader's two names, engine.begin, text(...), conn.fetchval; not the
    # executor's execute on line 7.
    assert sorted(use.split(":")[0] for use in found) == ["1", "2", "2", "4", "5", "6"]


def package_of(name: str) -> str:
    """The package of `app` a module belongs to: app.queue.core -> queue, app.cli -> cli."""
    return name.split(".")[1]


def package_imports() -> dict[str, dict[str, str]]:
    """For each package of `app`, the packages it imports, each with one place that does."""
    graph: dict[str, dict[str, str]] = {}
    for path in MODULES:
        importer = module_name(path)
        if importer == "app":
            continue
        edges = graph.setdefault(package_of(importer), {})
        for line, imported in imports_of(path):
            if within(imported, "app") and imported != "app":
                target = package_of(imported)
                if target != package_of(importer):
                    edges.setdefault(target, f"{path.relative_to(ROOT)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The cycles of `graph`, each once, as the list of packages around it."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                if frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    found.append([*path, start])
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_no_package_imports_itself_through_others() -> None:
    """The packages of `app` import each other in one direction only: every import counts
    (module level or inside a function), so a cycle cannot hide in a late import."""
    graph = package_imports()
    broken = [
        " -> ".join(cycle)
        + "  ("
        + ", ".join(graph[a][b] for a, b in itertools.pairwise(cycle))
        + ")"
        for cycle in cycles(graph)
    ]
    assert not broken, "\n".join(broken)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


NAMES_USED_TWICE: set[str] = set()
"""Names in transition, each used twice (none today: a new entry needs a reason)."""


def modules_by_name() -> dict[str, list[str]]:
    places: dict[str, list[str]] = {}
    for path in MODULES:
        if path.name != "__init__.py":
            places.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    return places


def test_no_module_name_is_used_twice() -> None:
    """A module's name says what it is wherever it is read: two `webhooks.py` in app/ make a
    traceback, a log line or an import ambiguous."""
    twice = {
        name: where
        for name, where in modules_by_name().items()
        if len(where) > 1 and name not in NAMES_USED_TWICE
    }
    assert not twice, "\n".join(f"{name}: {', '.join(where)}" for name, where in twice.items())


def test_the_allow_list_of_names_used_twice_is_current() -> None:
    places = modules_by_name()
    stale = sorted(name for name in NAMES_USED_TWICE if len(places.get(name, [])) < 2)
    assert not stale, f"no longer used twice (drop them from the list): {stale}"


FUNCTION_FILES = APP / "store" / "functions"
FROZEN = ROOT / "alembic" / "frozen"
MIGRATIONS = ROOT / "alembic" / "versions"
CREATE_FUNCTION = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(\w+)", re.IGNORECASE)


def test_no_function_text_exists_only_in_a_migration() -> None:
    """Every function a migration creates has its live text in app/store/functions/<name>.sql,
    migrations install only frozen copies (alembic/frozen/, never SQL written in a migration's
    code), and the newest frozen copy of each function is its live file (up to the first
    CREATE's OR REPLACE): a function's text is read in the store, whatever migrated it."""
    inline = [
        f"{path.relative_to(ROOT)}: CREATE FUNCTION {name}"
        for path in sorted(MIGRATIONS.glob("*.py"))
        for name in CREATE_FUNCTION.findall(path.read_text(encoding="utf-8"))
    ]
    newest: dict[str, Path] = {}
    for path in sorted(FROZEN.glob("*.sql")):
        for name in CREATE_FUNCTION.findall(path.read_text(encoding="utf-8")):
            newest[name] = path
    live = {path.stem for path in FUNCTION_FILES.glob("*.sql")}
    missing = sorted(set(newest) - live)

    def body(path: Path) -> str:
        text = path.read_text(encoding="utf-8")
        return re.sub(r"CREATE\s+OR\s+REPLACE\s+FUNCTION", "CREATE FUNCTION", text, count=1)

    drifted = [
        f"{path.relative_to(ROOT)} is not app/store/functions/{name}.sql"
        for name, path in sorted(newest.items())
        if name in live and body(path) != body(FUNCTION_FILES / f"{name}.sql")
    ]
    assert not inline, "\n".join(inline)
    assert not missing, "\n".join(f"no app/store/functions/{name}.sql" for name in missing)
    assert not drifted, "\n".join(drifted)
