"""The first hour's errors, as a person meets them (issue 38 item 4): real `turnstile` processes
given a bad setting, a bad or unreachable DATABASE_URL, a closed pipe or a port in use each say
so in one line naming what to change, with no traceback; `GET /` leads to the docs; the CLI's
help explains every flag."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import httpx
import pytest

from app.cli import build_parser
from app.store.embedded import free_port
from tests.support.processes import run_cli, turnstile


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"TURNSTILE_PORT": "eighty"}, "TURNSTILE_PORT"),
        ({"TURNSTILE_LOG_LEVEL": "loud"}, "TURNSTILE_LOG_LEVEL"),
        ({"TURNSTILE_HEARTBEAT_SECONDS": "20"}, "TURNSTILE_HEARTBEAT_SECONDS"),
        ({"TURNSTILE_SECRET_KEY": "short"}, "TURNSTILE_SECRET_KEY"),
    ],
)
async def test_a_setting_error_names_its_environment_variable(
    env: dict[str, str], named: str
) -> None:
    code, _, err = await run_cli("migrate", env=env)
    assert code == 2
    line = _one_line(err)
    assert named in line, line


@pytest.mark.parametrize(
    "args",
    [("migrate",), ("serve",), ("worker",), ("runs", "stuck"), ("keys", "list")],
)
async def test_a_database_url_of_another_scheme_is_one_line_naming_it(
    args: tuple[str, ...],
) -> None:
    code, _, err = await run_cli(*args, env={"DATABASE_URL": "mysql://root@127.0.0.1/app"})
    assert code == 2
    line = _one_line(err)
    assert "DATABASE_URL" in line, line
    assert "PostgreSQL" in line, line


@pytest.mark.parametrize(
    "args",
    [("migrate",), ("serve",), ("worker",), ("runs", "stuck"), ("schedules", "list")],
)
async def test_an_unreachable_database_is_one_line_naming_database_url(
    args: tuple[str, ...],
) -> None:
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    code, _, err = await run_cli(
        *args, env={"DATABASE_URL": nowhere, "TURNSTILE_WORKER_START_TIMEOUT_SECONDS": "0"}
    )
    assert code == 2
    line = _one_line(err)
    assert "DATABASE_URL" in line, line
    assert "127.0.0.1" in line, line


async def test_a_closed_pipe_ends_the_command_quietly(database_url: str) -> None:
    # As `turnstile schedules list --json | head -c 0`: the reader is gone before the write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            "schedules",
            "list",
            "--json",
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "DATABASE_URL": database_url},
        )
    finally:
        os.close(write_end)
    _, err = await process.communicate()
    assert err.decode() == ""
    assert process.returncode != 0  # as any tool whose output went nowhere


async def test_serve_checks_its_port_before_anything_starts(database_url: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, _, err = await asyncio.wait_for(
            run_cli("serve", "--port", str(port), env={"DATABASE_URL": database_url}), 120
        )
    assert code == 2
    line = _one_line(err)  # no schema line, no worker pool started and stopped
    for named in (str(port), "TURNSTILE_PORT", "--port"):
        assert named in line, line


async def test_the_root_leads_to_the_docs(database_url: str) -> None:
    port = free_port()
    async with (
        turnstile(
            "serve",
            "--no-workers",
            "--port",
            str(port),
            ready=b"Uvicorn running",
            env={"DATABASE_URL": database_url},
        ),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        response = await client.get("/")
    assert response.status_code == 307
    assert response.headers["location"] == "/docs"


def _parsers(parser: object, path: str = "turnstile") -> list[tuple[str, object]]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    found: list[tuple[str, object]] = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.extend(_parsers(child, f"{path} {name}"))
    return found


def test_every_flag_has_a_help_line() -> None:
    import argparse

    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in _parsers(build_parser())
        for action in parser._actions  # type: ignore[attr-defined]
        if not isinstance(action, argparse._SubParsersAction | argparse._HelpAction)
        and not action.help
    ]
    assert missing == []


async def test_help_says_what_migrate_does_and_that_the_cli_talks_to_the_database() -> None:
    code, out, _ = await run_cli("--help", env={})
    assert code == 0
    assert "database directly" in " ".join(out.split())
    code, out, _ = await run_cli("migrate", "--help", env={})
    assert code == 0
    assert "schema" in out.split("options:")[0].split("usage:")[-1].split("\n", 2)[-1]


async def test_webhooks_list_without_tenant_lists_every_tenants(database_url: str) -> None:
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_SECRET_KEY": "k" * 32,
        "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    }
    for tenant in ("acme", "globex"):
        code, _, err = await run_cli(
            "webhooks", "create", "--tenant", tenant, "--url", "http://127.0.0.1:9/hook", env=env
        )
        assert code == 0, err
    code, out, err = await run_cli("webhooks", "list", "--json", env=env)
    assert code == 0, err
    import json

    assert sorted(row["tenant"] for row in json.loads(out)) == ["acme", "globex"]


def test_every_command_has_an_example() -> None:
    import argparse

    leaves = [
        path
        for path, parser in _parsers(build_parser())
        if isinstance(parser, argparse.ArgumentParser)
        and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    ]
    assert len(leaves) > 20
    missing = [
        path
        for path, parser in _parsers(build_parser())
        if path in leaves
        and isinstance(parser, argparse.ArgumentParser)
        and not (parser.epilog or "").startswith("example:")
    ]
    assert missing == []


async def test_an_example_shows_in_help() -> None:
    code, out, _ = await run_cli("runs", "stuck", "--help", env={})
    assert code == 0
    assert "example:\n  turnstile runs stuck --queued-seconds 60 --json" in out
