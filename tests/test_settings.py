"""Settings people write by hand: any case where case means nothing; the HTTP server's
keep-alive longer than its clients'."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings


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
        ("submit_rate_per_second", -1, "above 0"),
        ("submit_rate_per_second", float("inf"), "above 0"),
        ("submit_rate_per_second", float("nan"), "above 0"),
        ("submit_burst", 0, "TURNSTILE_SUBMIT_BURST"),
    ],
)
def test_bad_submission_rate_limits_are_refused_with_what_to_write(
    field: str, value: float, says: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(**{field: value})  # type: ignore[arg-type]
    assert says in str(refused.value)
