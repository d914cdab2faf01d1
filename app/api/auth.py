"""Bearer API keys: who is calling, and whether their key's scope allows the action.

Verified keys are remembered for a few seconds per process, so a burst of requests costs one
lookup; revoking a key therefore takes effect within `KEY_CACHE_SECONDS` everywhere.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.problems import ApiProblem
from app.api.services import state_of
from app.queue.submit import Submitter
from app.security.api_keys import Caller, authenticate, hash_key

KEY_CACHE_SECONDS = 5.0
bearer = HTTPBearer(auto_error=False, description="An API key from `turnstile keys create`.")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="turnstile"'}


async def current_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiProblem("unauthorized", "missing bearer API key", headers=_CHALLENGE)
    state = state_of(request)
    cache: dict[bytes, tuple[float, Caller]] = state.key_cache
    digest = hash_key(credentials.credentials)
    hit = cache.get(digest)
    now = time.monotonic()
    if hit is not None and hit[0] > now:
        return hit[1]
    caller = await authenticate(state.engine, credentials.credentials)
    if caller is None:
        cache.pop(digest, None)
        raise ApiProblem("unauthorized", "unknown or revoked API key", headers=_CHALLENGE)
    if len(cache) > 10_000:
        cache.clear()
    cache[digest] = (now + KEY_CACHE_SECONDS, caller)
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
