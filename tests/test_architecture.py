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

Every `import` counts, at module level or inside a function. A failure names the module, the
line and the import.
"""

from __future__ import annotations

import ast
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
    if any(within(importer, owner) for owner in ("app.store", "app.queue", "app.security")):
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
    `app`, so it costs httpx and httpx-sse alone (tests/test_client.py checks the modules it
    loads) and a program with its own `app` package can use it."""
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
