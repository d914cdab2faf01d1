"""Bearer API keys: who is calling, and whether their key's scope allows the action.

Verified keys are remembered for a few seconds per process, so a burst of requests costs one
lookup; revoking a key therefore takes effect within `KEY_CACHE_SECONDS` everywhere (and on the
streams and long polls a key holds open within `TURNSTILE_STREAM_KEY_RECHECK_SECONDS`,
app/api/watch.py). A wrong key costs little: a string that is not shaped like a key is refused
without a statement, and a well-formed unknown one is remembered as unknown for
`UNKNOWN_KEY_CACHE_SECONDS` (a key made later cannot be among them: keys are random).
"""

from __future__ import annotations

import time
from typing import Annotated, TypeVar
from uuid import UUID

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.problems import ApiProblem
from app.api.services import state_of
from app.queue.submit import Submitter
from app.security.api_keys import Caller, authenticate, hash_key, looks_like_key

_V = TypeVar("_V")

KEY_CACHE_SECONDS = 5.0
UNKNOWN_KEY_CACHE_SECONDS = 5.0
KEY_CACHE_ENTRIES = 10_000  # of each kind; the oldest go first
bearer = HTTPBearer(auto_error=False, description="An API key from `turnstile keys create`.")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="turnstile"'}


class KeyCache:
    """Keys this process looked up lately, by their SHA-256: the caller of a known key for
    `KEY_CACHE_SECONDS`, an unknown or revoked key for `UNKNOWN_KEY_CACHE_SECONDS`. Known and
    unknown keys are kept apart, so a flood of random keys never pushes a real one out."""

    def __init__(self, entries: int = KEY_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._known: dict[bytes, tuple[float, Caller]] = {}
        self._unknown: dict[bytes, float] = {}

    def lookup(self, digest: bytes, now: float) -> tuple[bool, Caller | None]:
        """(True, caller) for a key remembered as known, (True, None) for one remembered as
        unknown, (False, None) when it must be looked up."""
        known = self._known.get(digest)
        if known is not None and known[0] > now:
            return True, known[1]
        unknown = self._unknown.get(digest)
        if unknown is not None and unknown > now:
            return True, None
        return False, None

    def remember(self, digest: bytes, caller: Caller | None, now: float) -> None:
        self._known.pop(digest, None)
        self._unknown.pop(digest, None)
        if caller is None:
            _bounded_put(self._unknown, digest, now + UNKNOWN_KEY_CACHE_SECONDS, self.entries)
        else:
            _bounded_put(self._known, digest, (now + KEY_CACHE_SECONDS, caller), self.entries)

    def forget(self, key_ids: set[UUID]) -> None:
        """Drop these keys (found revoked): their next request looks them up again."""
        for digest, (_, caller) in list(self._known.items()):
            if caller.key_id in key_ids:
                del self._known[digest]


def _bounded_put(table: dict[bytes, _V], digest: bytes, value: _V, entries: int) -> None:
    while len(table) >= entries:
        del table[next(iter(table))]  # dicts keep insertion order: the oldest entry
    table[digest] = value


async def current_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiProblem("unauthorized", "missing bearer API key", headers=CHALLENGE)
    secret = credentials.credentials
    if not looks_like_key(secret):
        raise ApiProblem("unauthorized", "unknown or revoked API key", headers=CHALLENGE)
    state = state_of(request)
    cache: KeyCache = state.key_cache
    digest = hash_key(secret)
    now = time.monotonic()
    found, caller = cache.lookup(digest, now)
    if not found:
        caller = await authenticate(state.engine, secret)
        cache.remember(digest, caller, now)
    if caller is None:
        raise ApiProblem("unauthorized", "unknown or revoked API key", headers=CHALLENGE)
    return caller


async def operator_caller(caller: Annotated[Caller, Depends(current_caller)]) -> Caller:
    if not caller.is_operator:
        raise ApiProblem("forbidden", "this action needs a key with the operator scope")
    return caller


async def admin_caller(caller: Annotated[Caller, Depends(current_caller)]) -> Caller:
    if not caller.is_admin:
        raise ApiProblem("forbidden", "this action needs a key with the admin scope")
    return caller


CallerDep = Annotated[Caller, Depends(current_caller)]
OperatorDep = Annotated[Caller, Depends(operator_caller)]
AdminDep = Annotated[Caller, Depends(admin_caller)]


def visible_tenant(caller: Caller) -> str | None:
    """The tenant a caller's reads are limited to; None for admin keys (the whole queue).
    Writes (cancel, resubmit, dismiss) always stay within the caller's own tenant."""
    return None if caller.is_admin else caller.tenant_id


def visible_principal(caller: Caller) -> str | None:
    """The principal a caller's reads and actions are limited to: its own for a key without a
    scope; None (every principal of the tenant) for operator and admin keys."""
    return None if caller.is_operator else caller.principal


def submitter_of(caller: Caller) -> Submitter:
    """Who the core records as submitting, and which sessions the caller may send turns to."""
    return Submitter(
        caller.tenant_id,
        caller.principal,
        caller.actor,
        own_sessions_only=not caller.is_operator,
    )
