"""The wheel carries the migrations: built from the repository's files, installed (not
editable) into a fresh virtualenv, its `turnstile migrate` brings an empty database to head
from an empty folder, reading the migrations shipped in the package (app/migrations)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import asyncpg
import pytest

from app.store.engine import plain_url
from app.store.migrate import head_revision

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "alembic.ini",
    "alembic",
    "app",
)


async def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    process = await asyncio.create_subprocess_exec(
        *map(str, args),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 300)
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"{' '.join(map(str, args))}:\n{text[-3000:]}"
    return text


@pytest.mark.slow
async def test_an_installed_wheel_migrates_from_an_empty_folder(
    tmp_path: Path, empty_database: str
) -> None:
    # A copy of what the repository holds, so the build leaves nothing in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DATABASE_URL")}
    # Without build isolation (the test extras bring setuptools), so nothing is downloaded.
    await run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", tmp_path / "dist", source, cwd=tmp_path, env=env,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("turnstile-*.whl")

    # A fresh virtualenv with the wheel installed in it, borrowing this environment's
    # dependencies through a path entry placed after its own site-packages (a plain path: the
    # editable install's finder in there is not loaded, so `app` can only be the wheel's).
    venv = tmp_path / "venv"
    await run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    own = await run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    borrowed = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    (Path(own.strip()) / "zz-borrowed.pth").write_text("\n".join(dict.fromkeys(borrowed)) + "\n")
    await run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
        "--no-index", wheel, cwd=tmp_path, env=env,
    )  # fmt: skip

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    where = await run(
        python, "-c", "from app.store.migrate import migrations_root; print(migrations_root())",
        cwd=empty, env=env,
    )  # fmt: skip
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's copy, not the checkout
    await run(
        venv / "bin" / "turnstile",
        "migrate",
        cwd=empty,
        env={**env, "DATABASE_URL": empty_database},
    )
    assert list(empty.iterdir()) == []  # nothing needed from, or written to, the folder
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        assert await conn.fetchval("SELECT version_num FROM alembic_version") == head_revision()
    finally:
        await conn.close()
