"""API keys: random secrets shown once, stored as SHA-256 hashes.

A key belongs to one tenant and one principal and may carry the `operator` scope (that tenant's
runbook actions) or the `admin` scope (the platform team: queue-wide views and any run). Keys
are long random strings, so a fast hash is enough; a slow password hash would put tens of
milliseconds on every request.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import TextClause
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import q

SCOPES = ("operator", "admin")
KEY_PREFIX = "ts_"


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


def statement(name: str) -> TextClause:
    """A named statement of app/store/sql/credentials.sql."""
    return q(name)


def hash_key(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _check(tenant_id: str, principal: str, scopes: tuple[str, ...]) -> None:
    if not tenant_id.strip() or not principal.strip():
        raise ValueError("tenant and principal must not be empty")
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
    _check(tenant_id, principal, scopes)
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                statement("key_create"),
                {
                    "now": None,
                    "hash": hash_key(secret),
                    "prefix": secret[:10],
                    "tenant": tenant_id,
                    "principal": principal,
                    "scopes": list(scopes),
                    "name": name,
                },
            )
        ).one()
    return NewKey(secret=secret, info=_info(row._mapping))


def _info(row: object) -> KeyInfo:
    m = dict(row)  # type: ignore[call-overload]
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
    """The caller a key belongs to, or None for an unknown or revoked key."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                statement("key_authenticate"),
                {"hash": hash_key(secret)},
            )
        ).one_or_none()
    if row is None:
        return None
    return Caller(
        key_id=row.id,
        tenant_id=row.tenant_id,
        principal=row.principal,
        scopes=frozenset(row.scopes),
    )


async def list_keys(engine: AsyncEngine, tenant_id: str | None = None) -> list[KeyInfo]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            statement("key_list"),
            {"tenant": tenant_id},
        )
        return [_info(row._mapping) for row in rows]


async def revoke_key(engine: AsyncEngine, key_id: UUID) -> bool:
    """Revoke a key and end its dashboard sessions; False when no such unrevoked key exists."""
    async with engine.begin() as conn:
        result = await conn.execute(statement("key_revoke"), {"id": key_id, "now": None})
        return result.one_or_none() is not None


async def has_any_key(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        return bool(await conn.scalar(statement("key_any")))
