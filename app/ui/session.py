"""Dashboard sign-in: an opaque, revocable session kept in PostgreSQL, named by a cookie.

- Signing in with an API key opens a session: a random token goes into the cookie, and only
  its SHA-256 hash into `dashboard_sessions`, with the key it belongs to and an expiry
  (`TURNSTILE_UI_SESSION_SECONDS`, 12 h by default). The key itself never leaves the sign-in
  request, so a copied cookie is worth no more than the session it names.
- Every dashboard request looks the session up (one statement, no cache): it must be unexpired
  and its key unrevoked. Signing out deletes the row, so a copy of the cookie stops working at
  once on every replica; revoking the key deletes its sessions too.
- The cookie is `HttpOnly` (page scripts never see it), `SameSite=Strict` (no other site's page
  can make the browser send it), path `/ui`, with no `Max-Age` or `Expires` (the browser forgets
  it when its session ends; the server's expiry holds either way), and `Secure` when the
  request came over HTTPS, including through a TLS proxy trusted by
  `TURNSTILE_TRUST_FORWARDED_HEADERS` (app/api/forwarded.py).
- POST actions carry a CSRF token derived from the session token (an HMAC under the token): a
  forging page cannot read the cookie, so it cannot compute the token, and the token needs no
  state of its own. POSTs whose `Origin` names another origin are refused as well.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import Response

from app.api.services import state_of
from app.security.api_keys import Caller
from app.security.dashboard_sessions import end_session, session_caller, start_session

COOKIE = "turnstile_ui"
COOKIE_PATH = "/ui"
MAX_KEY_LENGTH = 200
MAX_TOKEN_LENGTH = 100  # tokens are 43 characters; anything much longer is not one of ours


class SignInRequired(Exception):
    """No valid session in the cookie: the page answers with a redirect to the sign-in form."""


def token_of(request: Request) -> str | None:
    token = request.cookies.get(COOKIE)
    if not token or len(token) > MAX_TOKEN_LENGTH:
        return None
    return token


async def start(request: Request, key: str) -> tuple[str, Caller] | None:
    """Open a session for an unrevoked key: its token (for the cookie) and caller; None for an
    unknown or revoked key."""
    if not key or len(key) > MAX_KEY_LENGTH:
        return None
    state = state_of(request)
    token = secrets.token_urlsafe(32)
    caller = await start_session(
        state.engine, key=key, token=token, lifetime_seconds=state.settings.ui_session_seconds
    )
    return (token, caller) if caller is not None else None


async def end(request: Request) -> None:
    """Delete the request's session, if it has one: every copy of its cookie stops working."""
    token = token_of(request)
    if token is not None:
        await end_session(state_of(request).engine, token)


async def signed_in(request: Request) -> Caller:
    """The caller of the request's session; SignInRequired when there is no valid one."""
    token = token_of(request)
    caller = None if token is None else await session_caller(state_of(request).engine, token)
    if caller is None:
        raise SignInRequired()
    return caller


def csrf_token(token: str) -> str:
    return hmac.new(token.encode(), b"turnstile-ui-csrf", hashlib.sha256).hexdigest()


def csrf_valid(request: Request, csrf: str | None) -> bool:
    token = token_of(request)
    return bool(token and csrf and hmac.compare_digest(csrf_token(token), csrf))


def same_origin(request: Request) -> bool:
    """False when the request names an origin other than this server's (a cross-site POST)."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "") and parts.scheme == request.url.scheme


def remember(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        COOKIE,
        token,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        # The scheme is https behind a trusted TLS proxy too (app/api/forwarded.py).
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
