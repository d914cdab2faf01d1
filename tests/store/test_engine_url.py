"""An engine without a database URL (issue 38): embedding code that passes
`Settings().database_url` with DATABASE_URL unset gets one line naming the setting and the way to
the embedded PostgreSQL, not SQLAlchemy's "Expected string or URL object, got None"."""

from __future__ import annotations

import pytest

from app.config import Settings
from app.store.engine import create_engine


def test_no_url_names_database_url_and_the_embedded_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    settings = Settings()
    assert settings.database_url is None
    with pytest.raises(ValueError, match=r"DATABASE_URL.*resolve_database\(settings\)\.url"):
        create_engine(settings, settings.database_url)  # type: ignore[arg-type]
