"""Dashboard sign-in sessions, owned with the API keys they belong to (`dashboard_sessions`).

A session is opened for an unrevoked key, named by a random token of which only the SHA-256 is
stored, and expires; looking one up also requires its key to be unrevoked, and revoking a key
deletes its sessions (`api_keys.revoke_key`). The cookie, the CSRF token and the HTTP side live
in app/ui/session.py; the table's rows are the store's (app/store/access.py).
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import Caller, caller_of, hash_key, looks_like_key
from app.store import access


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def start_session(
    engine: AsyncEngine,
    *,
    key: str,
    token: str,
    lifetime_seconds: float,
    now: datetime | None = None,
) -> Caller | None:
    """Open a session named by `token` for the unrevoked key `key`; None for an unknown or
    revoked key (nothing is written then, and nothing is asked of the database for a string
    that is not even shaped like a key)."""
    if not looks_like_key(key):
        return None
    row = await access.insert_session(
        engine,
        token_hash=token_hash(token),
        key_hash=hash_key(key),
        lifetime_seconds=lifetime_seconds,
        now=now,
    )
    return caller_of(row) if row is not None else None


async def session_caller(
    engine: AsyncEngine, token: str, *, now: datetime | None = None
) -> Caller | None:
    """The caller of an unexpired session whose key is unrevoked; None otherwise."""
    row = await access.session_key(engine, token_hash(token), now=now)
    return caller_of(row) if row is not None else None


async def end_session(engine: AsyncEngine, token: str) -> None:
    """Delete the session: every copy of its cookie stops working."""
    await access.delete_session(engine, token_hash(token))
