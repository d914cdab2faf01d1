"""Dashboard sign-in: an API key kept in a browser-session cookie, checked like a bearer key.

- The cookie holds the key itself: `HttpOnly` (page scripts never see it), `SameSite=Strict`
  (no other site's page can make the browser send it), `Secure` behind HTTPS, path `/ui`, and
  no `Max-Age` or `Expires`, so the browser forgets it when the browser session ends. Keeping
  the key rather than a server-side session means every API replica accepts the cookie with no
  shared secret or session table, and revoking the key signs the browser out within the key
  cache's few seconds.
- Every request authenticates the cookie's key through the API's own `current_caller` (the
  same lookup, cache and revocation rules as `Authorization: Bearer`).
- POST actions carry a CSRF token derived from the key (an HMAC under the key itself): a
  forging page knows neither, and the token needs no server state either. POSTs whose
  `Origin` names another origin are refused as well.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials

from app.api.auth import current_caller
from app.api.problems import ApiProblem
from app.security.api_keys import Caller

COOKIE = "turnstile_ui"
COOKIE_PATH = "/ui"
MAX_KEY_LENGTH = 200


class SignInRequired(Exception):
    """No valid key in the cookie: the page answers with a redirect to the sign-in form."""


def key_of(request: Request) -> str | None:
    key = request.cookies.get(COOKIE)
    if not key or len(key) > MAX_KEY_LENGTH:
        return None
    return key


async def caller_for_key(request: Request, key: str) -> Caller | None:
    """The caller a key belongs to (the API's own check and cache), or None."""
    try:
        return await current_caller(
            request, HTTPAuthorizationCredentials(scheme="Bearer", credentials=key)
        )
    except ApiProblem:
        return None


async def signed_in(request: Request) -> Caller:
    key = key_of(request)
    caller = await caller_for_key(request, key) if key else None
    if caller is None:
        raise SignInRequired()
    return caller


def csrf_token(key: str) -> str:
    return hmac.new(key.encode(), b"turnstile-ui-csrf", hashlib.sha256).hexdigest()


def csrf_valid(request: Request, token: str | None) -> bool:
    key = key_of(request)
    return bool(key and token and hmac.compare_digest(csrf_token(key), token))


def same_origin(request: Request) -> bool:
    """False when the request names an origin other than this server's (a cross-site POST)."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "") and parts.scheme == request.url.scheme


def remember(response: Response, request: Request, key: str) -> None:
    response.set_cookie(
        COOKIE,
        key,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def forget(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
