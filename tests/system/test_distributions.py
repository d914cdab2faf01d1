"""The server and the clients as distributions, in real virtual environments: the server a
tool in an environment of its own, a user's project with its own `app` package in another.

Issue 37's scenario: a FastAPI-style project (package `app`, as nearly every one has) that
installs Turnstile's Python client. Here the server's wheel and a plugin package (an agent of
the user's, `pipx inject` style) are installed in environment A, whose `turnstile serve` runs;
the project and `turnstile-client` are installed with pip in environment B, which holds httpx
and its few dependencies and nothing of the server. The project runs a turn through the
server, answered by the plugin's agent; then it and the client are uninstalled; every file of
A is as it was before, and its server still serves.
"""

from __future__ import annotations

import asyncio
import email.parser
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from sqlalchemy.ext.asyncio import AsyncEngine

from app.installation import problem
from app.security.api_keys import create_key
from app.store.embedded import free_port
from tests.support.processes import turnstile

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER_SOURCES = (
    "pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "alembic.ini", "alembic", "app",
)  # fmt: skip
HEAVY = {"fastapi", "starlette", "sqlalchemy", "asyncpg", "uvicorn", "pydantic", "pgserver"}

PROJECT = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-chat"
version = "1.0.0"
dependencies = ["turnstile-client"]

[tool.setuptools]
packages = ["app"]
""",
    "app/__init__.py": '"""Acme\'s chat back end, with its own `app`."""\n\nOWNER = "acme-chat"\n',
    "app/main.py": """\
import os
import sys

import app
from turnstile_client import Turnstile


def main() -> None:
    assert app.OWNER == "acme-chat"  # our app, not the server's
    with Turnstile(os.environ["TURNSTILE_URL"], os.environ["TURNSTILE_KEY"]) as turnstile:
        session = turnstile.create_session()
        run = turnstile.submit_turn(session, {"name": "Ada"}, agent="greeter")
        run = turnstile.wait(run, timeout=60)
        print(run.status, run.result)
    print(sorted(name.split(".")[0] for name in sys.modules if name.split(".")[0] in {heavy}))


main()
""",
}

PLUGIN = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-agents"
version = "1.0.0"

[tool.setuptools]
packages = ["acme_agents"]
""",
    "acme_agents/__init__.py": "",
    "acme_agents/plugin.py": """\
from app.runtime.agents import Finish


class Greeter:
    name = "greeter"
    time_limit_seconds = 60

    async def decide(self, state):
        return Finish(f"hello, {state.inputs[0]['name']}")


def register(registry):
    registry.agents["greeter"] = Greeter()
""",
}


def write_tree(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text.replace("{heavy}", repr(HEAVY)), encoding="utf-8")
    return folder


def clean_env() -> dict[str, str]:
    drop = ("PYTHONPATH", "DATABASE_URL", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TURNSTILE_")}


async def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    process = await asyncio.create_subprocess_exec(
        *map(str, args),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env if env is not None else clean_env(),
    )
    out, _ = await asyncio.wait_for(process.communicate(), 300)
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"{' '.join(map(str, args))}:\n{text[-3000:]}"
    return text


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four wheels: the server's (from a copy of the repository's files), the client's, a
    user's project with its own `app`, and a plugin; built without build isolation (the test
    extras bring setuptools), so nothing is downloaded."""
    folder = tmp_path_factory.mktemp("wheels")
    server = folder / "server-src"
    server.mkdir()
    for name in SERVER_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, server / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, server / name)
    client = folder / "client-src"
    shutil.copytree(
        ROOT / "clients" / "python",
        client,
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
    )
    project = write_tree(folder / "acme-chat", PROJECT)
    plugin = write_tree(folder / "acme-agents", PLUGIN)
    dist = folder / "dist"
    for source in (server, client, project, plugin):
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(dist), str(source)],
            cwd=folder, env=clean_env(), check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    built = {path.name.split("-")[0]: path for path in dist.glob("*.whl")}
    assert set(built) == {"turnstile", "turnstile_client", "acme_chat", "acme_agents"}
    return built


async def venv(folder: Path) -> tuple[Path, Path]:
    """A fresh environment without pip (this one's pip installs into it): python, site-packages."""
    await run(sys.executable, "-m", "venv", "--without-pip", folder, cwd=folder.parent)
    python = folder / "bin" / "python"
    purelib = await run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=folder
    )
    return python, Path(purelib.strip())


async def pip(python: Path, *args: str | Path, cwd: Path) -> str:
    return await run(sys.executable, "-m", "pip", "--python", python, *args, cwd=cwd)


def borrow_dependencies(site: Path) -> None:
    """The server's dependencies in an environment, borrowed from this one through a path entry
    after its own site-packages (a plain path: the editable installs' finders in there are not
    loaded, so `app` can only be the environment's own)."""
    borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz-borrowed.pth").write_text("\n".join(borrowed) + "\n")


def wheel_requirements(wheel: Path) -> list[str]:
    """The `Requires-Dist` of a wheel, from its own metadata."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    return message.get_all("Requires-Dist") or []


def requirement_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `requirements` need, recursively, as this environment has
    them."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        key = requirement.name.lower().replace("_", "-")
        if key in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        dist = importlib.metadata.distribution(requirement.name)
        seen[key] = dist
        pending.extend(Requirement(r) for r in dist.requires or [])
    return list(seen.values())


def copy_installed(dists: list[importlib.metadata.Distribution], site: Path) -> None:
    """Install `dists` into `site` as they are installed here (their files and metadata), so
    pip in that environment sees them as installed: how B gets httpx without a network."""
    for dist in dists:
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # scripts outside site-packages; bytecode is made again
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(str(dist.locate_file(file))), target)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its content's hash (bytecode caches left out)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def installed_size(dist: importlib.metadata.Distribution) -> int:
    paths = (Path(str(dist.locate_file(file))) for file in dist.files or [])
    return sum(path.stat().st_size for path in paths if path.is_file())


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


async def test_a_project_with_its_own_app_package_uses_the_client_beside_a_server_elsewhere(
    tmp_path: Path, wheels: dict[str, Path], database_url: str, engine: AsyncEngine
) -> None:
    dist = wheels["turnstile"].parent
    # A: the server as a tool, with the plugin injected.
    server_python, server_site = await venv(tmp_path / "server-env")
    await pip(server_python, "install", "--quiet", "--no-deps", "--no-index",
              wheels["turnstile"], wheels["acme_agents"], cwd=tmp_path)  # fmt: skip
    borrow_dependencies(server_site)
    before = snapshot(tmp_path / "server-env")

    # B: the user's project environment: httpx and what it needs, nothing else.
    project_python, project_site = await venv(tmp_path / "project-env")
    needed = requirement_closure(wheel_requirements(wheels["turnstile_client"]))
    assert {d.metadata["Name"].lower() for d in needed} >= {"httpx", "httpx-sse", "httpcore"}
    copy_installed(needed, project_site)
    await pip(project_python, "install", "--quiet", "--no-index", "--find-links", dist,
              "acme-chat", cwd=tmp_path)  # fmt: skip
    listed = await pip(project_python, "list", "--format=freeze", cwd=tmp_path)
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"acme-chat", "turnstile-client", "httpx", "httpx-sse"} <= names
    assert "turnstile" not in names
    assert not names & HEAVY
    await pip(project_python, "check", cwd=tmp_path)  # every requirement met
    server_needs = requirement_closure(wheel_requirements(wheels["turnstile"]))
    print(
        f"environments: the project's, {len(names)} distributions in "
        f"{size_of(project_site) / 1e6:.1f} MB; the server's, {len(server_needs) + 2} in "
        f"{(size_of(server_site) + sum(map(installed_size, server_needs))) / 1e6:.1f} MB"
    )

    port = free_port()
    key = (await create_key(engine, tenant_id="acme", principal="alice")).secret
    server_env = {
        "PYTHONPATH": "",  # nothing of the checkout: A's `app` is the wheel's
        "DATABASE_URL": database_url,
        "TURNSTILE_PLUGINS": "acme_agents.plugin:register",
    }
    serve = ("serve", "--port", str(port))
    program = (str(tmp_path / "server-env" / "bin" / "turnstile"),)
    async with turnstile(
        *serve, ready=b"Uvicorn running", env=server_env, program=program, cwd=str(tmp_path)
    ):
        base = f"http://127.0.0.1:{port}"
        used = await run(
            project_python, "-m", "app.main", cwd=tmp_path,
            env={**clean_env(), "TURNSTILE_URL": base, "TURNSTILE_KEY": key},
        )  # fmt: skip
        assert used.splitlines() == ["succeeded hello, Ada", "[]"], used
        code = "import app, turnstile_client as c; print(app.__file__, c.__file__)"
        where = await run(project_python, "-c", code, cwd=tmp_path)
        assert all(Path(p).is_relative_to(project_site) for p in where.split()), where

        await pip(project_python, "uninstall", "--yes", "acme-chat", "turnstile-client",
                  cwd=tmp_path)  # fmt: skip
        assert not (project_site / "app").exists()
        # The server's environment is as it was, file for file, and it still serves.
        assert snapshot(tmp_path / "server-env") == before
        async with httpx.AsyncClient(
            base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            assert (await client.get("/readyz")).status_code == 200
            submitted = await client.post(
                "/runs", json={"input": {"name": "Bo"}, "agent": "greeter"}
            )
            assert submitted.status_code == 202, submitted.text
            run_doc = submitted.json()
            while run_doc["status"] not in ("succeeded", "failed"):
                polled = await client.get(
                    f"/runs/{run_doc['id']}", params={"wait": 30, "status": run_doc["status"]}
                )
                run_doc = polled.json()
            assert run_doc["result"] == "hello, Bo"


async def test_a_server_installed_beside_a_project_with_its_own_app_says_so(
    tmp_path: Path, wheels: dict[str, Path]
) -> None:
    """What the README says not to do: the server and a project that has its own `app` in one
    environment. pip lets the project overwrite `app/__init__.py`; the CLI names the culprit
    in one line instead of running on a mixed package, and after the project's uninstall (which
    deleted the file they shared) it says Turnstile's files are missing."""
    python, site = await venv(tmp_path / "shared-env")
    await pip(python, "install", "--quiet", "--no-deps", "--no-index", wheels["turnstile"],
              cwd=tmp_path)  # fmt: skip
    borrow_dependencies(site)
    command = tmp_path / "shared-env" / "bin" / "turnstile"
    env = {**clean_env(), "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}

    async def refused() -> str:
        process = await asyncio.create_subprocess_exec(
            str(command), "migrate", cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 2, (out + err).decode()
        (line,) = err.decode().splitlines()  # one line, no traceback
        return line

    await pip(python, "install", "--quiet", "--no-deps", "--no-index", wheels["acme_chat"],
              cwd=tmp_path)  # fmt: skip
    assert "OWNER" in (site / "app" / "__init__.py").read_text()  # overwritten, as pip does
    overwritten = await refused()
    assert overwritten.startswith("turnstile: acme-chat 1.0.0 also installed files into ")
    assert "pipx install turnstile" in overwritten

    await pip(python, "uninstall", "--yes", "acme-chat", cwd=tmp_path)
    assert not (site / "app" / "__init__.py").exists()  # the shared file went with it
    damaged = await refused()
    assert damaged.startswith("turnstile: Turnstile's files are missing from this environment (")
    assert "app/__init__.py" in damaged


def test_a_checkout_is_not_an_installation_to_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build in a checkout (`pip wheel .`, `python -m build`) leaves `turnstile.egg-info`
    there, listing the sources as they were: first on the path of `python -m app.cli`, it is
    not an installation whose files can go missing (the suite's processes failed on one)."""
    egg = tmp_path / "turnstile.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: turnstile\nVersion: 0.1.0\n")
    (egg / "SOURCES.txt").write_text("app/__init__.py\napp/moved_away.py\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.metadata.distribution("turnstile").read_text("SOURCES.txt")
    assert problem() is None
