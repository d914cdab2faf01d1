"""The credentials' rows: API keys and the dashboard's sign-in sessions
(app/store/sql/credentials.sql). The store keeps hashes only and answers rows; what a key is, who
calls with it and what a session's cookie says are app/security's.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import q


async def insert_key(
    engine: AsyncEngine,
    *,
    key_hash: bytes,
    prefix: str,
    tenant_id: str,
    principal: str,
    scopes: list[str],
    name: str | None,
) -> RowMapping:
    """The new key's row (without its secret, which is never stored)."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("key_create"),
            {
                "now": None,
                "hash": key_hash,
                "prefix": prefix,
                "tenant": tenant_id,
                "principal": principal,
                "scopes": scopes,
                "name": name,
            },
        )
        return result.mappings().one()


async def key_by_hash(engine: AsyncEngine, key_hash: bytes) -> RowMapping | None:
    """The unrevoked key with this hash: id, tenant_id, principal, scopes."""
    async with engine.connect() as conn:
        result = await conn.execute(q("key_authenticate"), {"hash": key_hash})
        return result.mappings().one_or_none()


async def unrevoked_key_ids(engine: AsyncEngine, key_ids: list[UUID]) -> set[UUID]:
    async with engine.connect() as conn:
        rows = await conn.execute(q("keys_active"), {"ids": key_ids})
        return {row.id for row in rows}


async def key_rows(engine: AsyncEngine, tenant_id: str | None) -> list[RowMapping]:
    """Every key's row (of one tenant, or of all when `tenant_id` is None)."""
    async with engine.connect() as conn:
        result = await conn.execute(q("key_list"), {"tenant": tenant_id})
        return list(result.mappings().all())


async def revoke_key(engine: AsyncEngine, key_id: UUID) -> bool:
    """Revoke the key and delete its sessions; False when no such unrevoked key exists."""
    async with engine.begin() as conn:
        result = await conn.execute(q("key_revoke"), {"id": key_id, "now": None})
        return result.one_or_none() is not None


async def any_key(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        return bool(await conn.scalar(q("key_any")))


async def insert_session(
    engine: AsyncEngine,
    *,
    token_hash: bytes,
    key_hash: bytes,
    lifetime_seconds: float,
    now: datetime | None,
) -> RowMapping | None:
    """A session for the unrevoked key with `key_hash`: its key's row, or None (nothing written)
    for an unknown or revoked key."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("session_start"),
            {
                "token_hash": token_hash,
                "key_hash": key_hash,
                "lifetime_seconds": lifetime_seconds,
                "now": now,
            },
        )
        return result.mappings().one_or_none()


async def session_key(
    engine: AsyncEngine, token_hash: bytes, *, now: datetime | None
) -> RowMapping | None:
    """The key's row of an unexpired session whose key is unrevoked."""
    async with engine.connect() as conn:
        result = await conn.execute(q("session_caller"), {"token_hash": token_hash, "now": now})
        return result.mappings().one_or_none()


async def delete_session(engine: AsyncEngine, token_hash: bytes) -> None:
    async with engine.begin() as conn:
        await conn.execute(q("session_end"), {"token_hash": token_hash})
