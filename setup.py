"""The one build step pyproject.toml cannot say: ship the migrations inside the package.

`alembic.ini` and `alembic/` stay at the top of the repository, where the design has them and
where `alembic` and `turnstile migrate` find them in a checkout. A built wheel also carries a
copy under `app/migrations/`, so an installed Turnstile (`pip install .`, the container image)
can run `turnstile migrate` from any folder (`app/store/migrate.py: migrations_root` looks there
first). Editable installs read the checkout's own files and need no copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithMigrations(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "app" / "migrations"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "alembic.ini", target / "alembic.ini")
        shutil.copytree(
            ROOT / "alembic",
            target / "alembic",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )


setup(cmdclass={"build_py": BuildWithMigrations})
