"""Webhook deliveries, runtime side: the built-in `webhook` agent and its one tool, which POSTs
a delivery run's body to its endpoint, signed per the Standard Webhooks specification.

A delivery is an async-class run that a transition inserted (app/store/sql/runs.sql's
`webhook_deliveries` fragment); its input is the JSON body to send. The agent calls
`webhook_deliver` once, then finishes with the receiver's status. The tool:
- reads the endpoint as it is now (`WebhookTargets.target`): a deleted or disabled endpoint is a
  permanent failure; the secret is decrypted here (AES-GCM, app/security/secret_box.py);
- sends through `HttpRequestTool.request`, so the URL passes the same allow-list and address
  checks as `http_request`, again at every attempt (a refusal is permanent);
- signs `{webhook-id}.{webhook-timestamp}.{body}` with HMAC-SHA256 under the decoded secret
  (`webhook-signature: v1,<base64>`); `webhook-id` is the delivery's id (its run's id, kept in
  its input so a resubmitted dead letter sends the same one), the same on every retry, so a
  receiver drops repeats by it. The timestamp is the sending process's wall clock:
  it is what receivers compare with theirs to refuse replays;
- is `keyed` (a repeat carries the same webhook-id), with no retries inside the run: a timeout,
  429 or 5xx releases the run early and the queue retries it with the delivery backoff
  (TURNSTILE_WEBHOOK_*), up to its own attempts, then the dead letter; any other non-2xx
  answer is permanent. A failed delivery (a permanent refusal by the receiver, or its last
  attempt failing) is counted on the endpoint, a delivered one resets the count; at
  `DISABLE_AFTER` failed deliveries in a row the endpoint is disabled and the delivery that
  disabled it records a `webhook.endpoint_disabled` event (app/queue/webhook_endpoints.py).

An A2A push configuration's delivery (format 'a2a', `a2a_push`) sends the A2A StreamResponse
of the transition (app/protocols/a2a.py's `push_payload`) with `X-A2A-Notification-Token` and
the configuration's `Authorization`, signed as above with the token as the key (the one secret
the receiver shares with us). Everything else (checks, retries, counts) is the same.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import ClassVar, Protocol
from uuid import UUID

from app.protocols import a2a
from app.queue.webhook_endpoints import (
    FORMAT_A2A,
    WEBHOOK_AGENT,
    DeliveryTarget,
    Disabled,
    Endpoint,
    TaskPushConfig,
    Webhooks,
)
from app.runtime.agents import AgentError, CallTool, Decision, Finish
from app.runtime.http_tool import HttpRequestTool
from app.runtime.state import RunState
from app.runtime.tools import (
    IdempotencyClass,
    PermanentToolError,
    ToolContext,
    ToolError,
    TransientToolError,
)
from app.security.secret_box import SecretBox, SecretKeyMissingError, new_signing_secret
from app.vocabulary.records import JSON

log = logging.getLogger("turnstile.webhooks")

AGENT = WEBHOOK_AGENT
TOOL = "webhook_deliver"


class WebhookTargets(Protocol):
    """What a delivery needs of the core (app/queue/webhook_endpoints.py: Webhooks)."""

    async def target(self, delivery_run_id: UUID, endpoint_id: UUID) -> DeliveryTarget | None: ...

    async def delivery_succeeded(self, endpoint_id: UUID) -> None: ...

    async def delivery_failed(self, endpoint_id: UUID) -> Disabled | None: ...


class SecretOpener(Protocol):
    def decrypt(self, stored: bytes) -> bytes: ...


def signature(secret: bytes, webhook_id: str, timestamp: str, body: bytes) -> str:
    """The Standard Webhooks `webhook-signature` value."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def a2a_push(body: JSON, stored: bytes) -> tuple[JSON, bytes, dict[str, str]]:
    """An A2A push notification of a delivery: the StreamResponse it sends, the key of its
    Standard Webhooks signature (the configuration's token, which the receiver knows) and the
    headers A2A names: `X-A2A-Notification-Token`, and `Authorization` from the
    configuration's authentication (scheme and credentials, as the a2a-sdk sends them)."""
    try:
        kept = json.loads(stored)
        token, scheme, credentials = (str(kept[k]) for k in ("token", "scheme", "credentials"))
    except (ValueError, KeyError, TypeError):
        raise PermanentToolError("the push configuration's stored token is unreadable") from None
    headers = {"X-A2A-Notification-Token": token}
    if scheme and credentials:
        headers["Authorization"] = f"{scheme} {credentials}"
    return a2a.push_payload(body), token.encode(), headers


class WebhookAgent:
    name = AGENT
    time_limit_seconds: float | None = None

    async def decide(self, state: RunState) -> Decision:
        first = state.inputs[0] if state.inputs else None
        if not isinstance(first, dict):
            raise AgentError("a webhook delivery's input must be an object", permanent=True)
        if not state.tools:
            return [CallTool(tool=TOOL, args=dict(first))]
        return Finish({"delivered": state.tools[-1].outcome})


class WebhookDeliveryTool:
    name = TOOL
    description = "Deliver a webhook (internal to the `webhook` agent)."
    parameters: ClassVar[dict[str, JSON]] = {"type": "object"}
    transient_retries = 0  # see the module's docstring

    def __init__(
        self,
        targets: WebhookTargets,
        http: HttpRequestTool,
        secrets: SecretOpener | None,
        *,
        on_attempt: Callable[[str], None] | None = None,
        on_disabled: Callable[[], None] | None = None,
    ) -> None:
        self.targets = targets
        self.http = http
        self.secrets = secrets
        # Called with the attempt's outcome: delivered, retry or refused (the metrics).
        self.on_attempt = on_attempt or (lambda outcome: None)
        self.on_disabled = on_disabled or (lambda: None)

    def idempotency_class(self, args: dict[str, JSON]) -> IdempotencyClass:
        return "keyed"

    async def run(self, args: dict[str, JSON], ctx: ToolContext) -> JSON:
        try:
            webhook_id = str(UUID(str(args.get("webhook_id"))))
            endpoint_id = UUID(str(args.get("endpoint_id")))
        except ValueError:
            raise PermanentToolError("this run is not a webhook delivery") from None
        target = await self.targets.target(UUID(ctx.run_id), endpoint_id)
        try:
            if target is None:
                raise PermanentToolError("the webhook endpoint is not this tenant's")
            if not target.live:
                raise PermanentToolError("the webhook endpoint was deleted or disabled")
            if self.secrets is None:
                raise PermanentToolError(
                    "TURNSTILE_SECRET_KEY is not set: cannot sign the delivery"
                )
            try:
                secret = self.secrets.decrypt(target.secret_ciphertext)
            except RuntimeError as exc:  # SecretUnreadableError: the key changed
                raise PermanentToolError(str(exc)) from None
        except PermanentToolError:
            self.on_attempt("refused")
            raise
        payload: JSON = args.get("body")
        extra: dict[str, str] = {}
        if target.format == FORMAT_A2A:
            payload, secret, extra = a2a_push(payload, secret)
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": timestamp,
            "webhook-signature": signature(secret, webhook_id, timestamp, body),
            **extra,
        }
        try:
            answer = await self.http.request("POST", target.url, headers, content=body)
            status = answer["status"] if isinstance(answer, dict) else None
            if not isinstance(status, int) or not 200 <= status < 300:
                raise PermanentToolError(f"the receiver answered HTTP {status}")
        except (PermanentToolError, TransientToolError) as exc:
            self.on_attempt("retry" if isinstance(exc, TransientToolError) else "refused")
            log.info(
                "webhook delivery attempt failed",
                extra={
                    "run_id": ctx.run_id,
                    "endpoint_id": str(target.endpoint_id),
                    "error": str(exc),
                },
            )
            # The delivery has failed when this attempt was its last: a permanent refusal, or
            # a transient one with no attempt left (the queue dead-letters it). Earlier failed
            # attempts of the same delivery are not counted: an endpoint is judged by its
            # deliveries, not by how often one of them was retried.
            if isinstance(exc, PermanentToolError) or ctx.attempt >= ctx.max_attempts:
                await self._delivery_failed(target.endpoint_id, ctx)
            raise
        self.on_attempt("delivered")
        await self.targets.delivery_succeeded(target.endpoint_id)
        return {"status": status, "webhook_id": webhook_id}

    async def _delivery_failed(self, endpoint_id: UUID, ctx: ToolContext) -> None:
        disabled = await self.targets.delivery_failed(endpoint_id)
        if disabled is None:
            return
        # Said durably on the delivery that disabled it (its run's events, the dead letter's
        # page), besides the log line and the metric.
        self.on_disabled()
        log.warning(
            "webhook endpoint disabled after %s failed deliveries in a row",
            disabled.consecutive_failures,
            extra={"endpoint_id": str(endpoint_id), "run_id": ctx.run_id},
        )
        if ctx.emit is not None:
            await ctx.emit(
                "webhook.endpoint_disabled",
                {
                    "endpoint_id": str(endpoint_id),
                    "consecutive_failed_deliveries": disabled.consecutive_failures,
                    "disable_after": disabled.disable_after,
                },
            )


class DestinationRefusedError(Exception):
    """The URL fails the http_request tool's allow-list or address checks."""


async def register_endpoint(
    webhooks: Webhooks,
    egress: HttpRequestTool,
    box: SecretBox | None,
    *,
    tenant_id: str,
    principal: str,
    url: str,
    events: list[str],
) -> tuple[Endpoint, str]:
    """Check and store a new endpoint (the API's and the CLI's one path); returns it with its
    signing secret in the shown-once form. Raises SecretKeyMissingError without
    TURNSTILE_SECRET_KEY, DestinationRefusedError for a URL the egress checks refuse."""
    if box is None:
        raise SecretKeyMissingError(
            "webhooks need TURNSTILE_SECRET_KEY (at least 32 characters) to store their "
            "signing secrets encrypted; set it and restart"
        )
    try:
        await egress.check_url(url)
    except ToolError as exc:
        raise DestinationRefusedError(f"url: {exc}") from None
    shown, raw = new_signing_secret()
    endpoint = await webhooks.create(
        tenant_id=tenant_id,
        principal=principal,
        url=url,
        events=sorted(set(events)),
        secret=box.encrypt(raw),
    )
    return endpoint, shown


async def register_task_push(
    webhooks: Webhooks,
    egress: HttpRequestTool,
    box: SecretBox | None,
    *,
    tenant_id: str,
    principal: str,
    run_id: UUID,
    url: str,
    secret: bytes,
) -> TaskPushConfig:
    """Check and store an A2A task's push configuration (`secret`: a2a.push_secret's, kept
    encrypted as a webhook's signing secret is). Raises as `register_endpoint` does."""
    box = await check_push_destination(egress, box, url)
    return await webhooks.create_task_push(
        tenant_id=tenant_id,
        principal=principal,
        run_id=run_id,
        url=url,
        secret=box.encrypt(secret),
    )


async def check_push_destination(
    egress: HttpRequestTool, box: SecretBox | None, url: str
) -> SecretBox:
    """The box that stores a push configuration's token, once the URL passes the egress
    checks (before a SendMessage submits, so a refused one leaves no task)."""
    if box is None:
        raise SecretKeyMissingError(
            "push notifications need TURNSTILE_SECRET_KEY (at least 32 characters) to store "
            "their tokens encrypted"
        )
    try:
        await egress.check_url(url)
    except ToolError as exc:
        raise DestinationRefusedError(f"url: {exc}") from None
    return box
