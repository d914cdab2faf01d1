"""API keys: random secrets shown once, stored as SHA-256 hashes (their rows are the store's,
app/store/access.py).

A key belongs to one tenant and one principal and may carry the `operator` scope (that tenant's
runbook actions) or the `admin` scope (the platform team: queue-wide views and any run). Keys
are long random strings, so a fast hash is enough; a slow password hash would put tens of
milliseconds on every request.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store import access
from app.vocabulary.names import principal_name, tenant_name

SCOPES = ("operator", "admin")
KEY_PREFIX = "ts_"
# What `create_key` makes: the prefix and 32 random bytes in URL-safe base64 without padding.
KEY_SHAPE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}", re.ASCII)


@dataclass(frozen=True)
class Caller:
    """Who is making a request, as established by their API key."""

    key_id: UUID
    tenant_id: str
    principal: str
    scopes: frozenset[str]

    @property
    def is_operator(self) -> bool:
        return "operator" in self.scopes or "admin" in self.scopes

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def actor(self) -> str:
        """How operator actions name the acting key in run events."""
        return f"key:{self.key_id} ({self.tenant_id}/{self.principal})"


@dataclass(frozen=True)
class KeyInfo:
    id: UUID
    prefix: str
    tenant_id: str
    principal: str
    scopes: tuple[str, ...]
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class NewKey:
    secret: str  # shown once, never stored
    info: KeyInfo


def looks_like_key(secret: str) -> bool:
    """Whether `secret` has the shape of a key this service makes: anything else is refused
    without a statement."""
    return KEY_SHAPE.fullmatch(secret) is not None


def hash_key(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _check_scopes(scopes: tuple[str, ...]) -> None:
    unknown = set(scopes) - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown scope(s): {', '.join(sorted(unknown))}")


async def create_key(
    engine: AsyncEngine,
    *,
    tenant_id: str,
    principal: str,
    scopes: tuple[str, ...] = (),
    name: str | None = None,
) -> NewKey:
    """A new key for the tenant and principal, under their normalised names (app/security/
    names.py); ValueError (InvalidNameError for a name) when the names or scopes are refused."""
    tenant_id, principal = tenant_name(tenant_id), principal_name(principal)
    _check_scopes(scopes)
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    row = await access.insert_key(
        engine,
        key_hash=hash_key(secret),
        prefix=secret[:10],
        tenant_id=tenant_id,
        principal=principal,
        scopes=list(scopes),
        name=name,
    )
    return NewKey(secret=secret, info=_info(row))


def caller_of(row: RowMapping) -> Caller:
    """The caller a key's row names."""
    return Caller(
        key_id=row["id"],
        tenant_id=row["tenant_id"],
        principal=row["principal"],
        scopes=frozenset(row["scopes"]),
    )


def _info(m: RowMapping) -> KeyInfo:
    return KeyInfo(
        id=m["id"],
        prefix=m["prefix"],
        tenant_id=m["tenant_id"],
        principal=m["principal"],
        scopes=tuple(m["scopes"]),
        name=m["name"],
        created_at=m["created_at"],
        revoked_at=m["revoked_at"],
    )


async def authenticate(engine: AsyncEngine, secret: str) -> Caller | None:
    """The caller a key belongs to, or None for an unknown or revoked key (without a statement
    when it does not even look like one)."""
    if not looks_like_key(secret):
        return None
    row = await access.key_by_hash(engine, hash_key(secret))
    return caller_of(row) if row is not None else None


async def active_keys(engine: AsyncEngine, key_ids: set[UUID]) -> set[UUID]:
    """Which of `key_ids` are still unrevoked (revoked and deleted ones are left out)."""
    if not key_ids:
        return set()
    return await access.unrevoked_key_ids(engine, sorted(key_ids))


async def list_keys(engine: AsyncEngine, tenant_id: str | None = None) -> list[KeyInfo]:
    return [_info(row) for row in await access.key_rows(engine, tenant_id)]


async def revoke_key(engine: AsyncEngine, key_id: UUID) -> bool:
    """Revoke a key and end its dashboard sessions; False when no such unrevoked key exists."""
    return await access.revoke_key(engine, key_id)


async def has_any_key(engine: AsyncEngine) -> bool:
    return await access.any_key(engine)
