"""Settings people write by hand: any case where case means nothing; the HTTP server's
keep-alive longer than its clients'; streaming from the model turned off by its variable; the
tenants' limits (docs/adr/0006), with a one-line message naming what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.vocabulary.classes import parse_class_limits
from tests.support.processes import run_cli


def test_the_log_level_is_read_in_any_case() -> None:
    assert Settings(log_level="INFO").log_level == "info"
    assert Settings(log_level="Warning").log_level == "warning"
    with pytest.raises(ValidationError):
        Settings(log_level="loud")


def test_the_server_keeps_idle_connections_longer_than_clients_do() -> None:
    """The keep-alive race: a server that closes an idle connection just as a client sends on
    it loses that request. Clients (httpx: 5 s) and load balancers (often 60 s) close first."""
    from app.main import create_app
    from app.roles import server_config

    settings = Settings(database_url="postgresql://nobody@127.0.0.1:1/none")
    assert server_config(settings, create_app(settings)).timeout_keep_alive == 75
    shorter = Settings(
        database_url="postgresql://nobody@127.0.0.1:1/none", http_keep_alive_seconds=30
    )
    assert server_config(shorter, create_app(shorter)).timeout_keep_alive == 30


def test_submission_rate_limit_settings_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().submit_rate_per_second is None  # unset: no limit
    monkeypatch.setenv("TURNSTILE_SUBMIT_RATE_PER_SECOND", "2.5")
    monkeypatch.setenv("TURNSTILE_SUBMIT_BURST", "10")
    settings = Settings()
    assert (settings.submit_rate_per_second, settings.submit_burst) == (2.5, 10)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("submit_rate_per_second", 0, "TURNSTILE_SUBMIT_RATE_PER_SECOND; unset it for no limit"),
        ("submit_rate_per_second", -1, "(one a day)"),
        ("submit_rate_per_second", 1e-300, "(one a day)"),
        ("submit_rate_per_second", float("inf"), "(one a day)"),
        ("submit_rate_per_second", float("nan"), "(one a day)"),
        ("submit_burst", 0, "TURNSTILE_SUBMIT_BURST"),
    ],
)
def test_bad_submission_rate_limits_are_refused_with_what_to_write(
    field: str, value: float, says: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(**{field: value})  # type: ignore[arg-type]
    assert says in str(refused.value)


def test_streaming_from_the_model_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().openai_stream is True
    monkeypatch.setenv("TURNSTILE_OPENAI_STREAM", "false")
    assert Settings().openai_stream is False
    monkeypatch.setenv("TURNSTILE_OPENAI_STREAM", "maybe")
    with pytest.raises(ValidationError):
        Settings()


def test_the_tenant_limits_settings() -> None:
    assert parse_class_limits("4") == (4, 4, 4)
    assert parse_class_limits("interactive:2, async:8") == (2, 8, None)
    assert Settings(tenant_max_running="async:3").tenant_running_limits == (None, 3, None)
    assert Settings().tenant_running_limits == (None, None, None)
    assert Settings(tenant_max_queued=100).tenant_max_queued == 100
    for bad, says in (
        ("lots", "must be a number or look like 'class:N'"),
        ("urgent:3", "unknown class 'urgent'"),
        ("async:2,async:3", "class async given twice"),
        ("async:-1", "must be a number"),
    ):
        with pytest.raises(ValidationError, match=says):
            Settings(tenant_max_running=bad)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(tenant_max_queued=-1)


async def test_a_bad_tenant_limit_stops_the_worker_with_one_line(database_url: str) -> None:
    code, _, err = await run_cli(
        "worker",
        env={"DATABASE_URL": database_url, "TURNSTILE_TENANT_MAX_RUNNING": "async:many"},
    )
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "tenant_max_running" in err.lower(), err
