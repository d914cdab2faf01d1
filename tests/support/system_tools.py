"""Finding system tools (PgBouncer, Chromium) for the tests that need them.

On a developer's machine a missing tool skips the test with a one-line reason. Under
`TURNSTILE_REQUIRE_SYSTEM_TESTS=1` (set by `.ci/run`, which installs the tools) it fails instead,
so CI can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def require_tool(name: str, *candidates: str) -> Path:
    """The path of tool `name` (or one of `candidates`), else skip or fail as above."""
    for candidate in (name, *candidates):
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return Path(found)
    message = f"{name} not found (install it: apt-get install {name})"
    if os.environ.get("TURNSTILE_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(f"{message}; TURNSTILE_REQUIRE_SYSTEM_TESTS=1 requires it")
    pytest.skip(message)


def require_or_skip(name: str, reason: str) -> None:
    """A system component the test needs is missing (`reason`): skip, or fail under
    TURNSTILE_REQUIRE_SYSTEM_TESTS=1."""
    message = f"{name} is not available: {reason}"
    if os.environ.get("TURNSTILE_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail(f"{message}; TURNSTILE_REQUIRE_SYSTEM_TESTS=1 requires it")
    pytest.skip(message)
