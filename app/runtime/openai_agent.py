"""The `openai` agent: drives any OpenAI-compatible chat-completions endpoint with tool calling
(hosted services, or self-hosted servers such as vLLM or Ollama that speak the same API).

The message list is rebuilt from the run's state at every decision, never trusted from memory:
a run starts with the service's prompt and its first input's `instructions` (a string, as the
Responses API's `instructions` arrive) as system messages (its `upstream_model`, a string,
names the model asked instead of the service's: the Responses API's `model: "openai:<model>"`);
a run of a session then has the session's history (`RunState.history`, turned into messages and
cut to `history_max_messages` and `history_max_chars` by app/runtime/history.py, oldest
exchanges first); then the first input is the user's message (its `text` when it is an object);
each assistant turn the model produced is kept in `state.agent["turns"]` with the runtime steps
its tool calls became; every tool call's result comes from the run's recorded tool outcomes (an
`uncertain` one reaches the model as "the outcome is unknown", never as a failure), and answers
to `ask_user` from the run's answers. A tool call that a recovered run settled but whose turn
was lost in the crash gets a turn of its own, so the model always sees every call that may have
had an effect.

Failures: timeouts, 429 (honouring Retry-After) and 5xx are transient and retried here with
bounded backoff, then reported as transient (the run is released early); other 4xx, malformed
responses and unknown tool names are permanent and fail the run with what the endpoint said.
The API key never appears in a failure or a log line. Token usage is summed on the run.

Model budgets (docs/model-budgets.md): when the run has a `ModelCapacity`, every sending first
reserves one request and its estimated tokens (the request's bytes over 4, plus
`max_output_tokens` or OUTPUT_ESTIMATE_TOKENS) on the endpoint's budget, and settles them with
the usage the provider reports; no room gives the run's slot back (`CapacityWait`). A 429
pauses the endpoint for every process for its Retry-After (at least the backoff) instead of
this run sleeping in its slot. The rate-limit headers of every answer (x-ratelimit-limit-,
-remaining-, -reset- of requests and tokens) go to the budget (`provider_limits`): its rate
is never above the provider's limits, its buckets never above what the provider says remains.

Streaming (the default; `stream=False` turns it off for endpoints that cannot): the request
asks for `stream: true`, the text of the answer goes out live as it arrives (`RunState.output`,
app/runtime/live.py), tool calls are assembled from their streamed fragments, and the streamed
chunks are put back together into the same reply a non-streaming call returns. A stream that
breaks off is retried like a failed call, its partial text voided (`restart`). A streamed
answer ends with the durable `message.completed` event before the run's next durable event. An
endpoint that answers a streaming request with plain JSON is taken as is (nothing live, no
`message.completed`: its text is in the result, as with streaming off).

Bounds: the answer is read through `ModelClient` (aiohttp, app/runtime/outbound.py) within
`max_response_bytes` in all and `max_line_bytes` per streamed line; an answer past either fails
the run (permanent: the same request would get the same answer) and is not read further.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from app.observability import tracing
from app.queue.model_budgets import ProviderLimits, Reservation, endpoint_key, estimate_tokens
from app.runtime.agents import AgentError, Ask, CallTool, Decision, Finish
from app.runtime.history import UNKNOWN_RESULT, chat_messages, trim_history
from app.runtime.live import LiveOutput
from app.runtime.outbound import ModelClient, TooLarge, lines, read_body, read_excerpt
from app.runtime.state import RunState
from app.runtime.tools import Tool
from app.vocabulary.records import JSON

log = logging.getLogger("turnstile.openai")
ASK_USER = "ask_user"
# What a failure quotes of an endpoint's answer (failures are tenant-visible, stored with runs).
EXCERPT_CHARS = 500
# What the model is told of an `uncertain` call, in the run and in a later run's history alike.
UNKNOWN = UNKNOWN_RESULT
# What is read of an answer at most (TURNSTILE_OPENAI_MAX_RESPONSE_BYTES, _MAX_LINE_BYTES): the
# whole body, and one line of a stream; past either the run fails and nothing more is read.
MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_LINE_BYTES = 1024 * 1024
# What is read of a failed answer, for its excerpt.
ERROR_READ_BYTES = 16 * 1024
# The output a call is assumed to produce when the request sets no bound
# (TURNSTILE_OPENAI_MAX_OUTPUT_TOKENS), for its reservation on the endpoint's budget.
OUTPUT_ESTIMATE_TOKENS = 1024


class OpenAIAgent:
    name = "openai"
    time_limit_seconds: float | None = None

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None,
        tools: Callable[[], Mapping[str, Tool]],
        timeout_seconds: float = 60.0,
        retries: int = 3,
        backoff_seconds: float = 0.5,
        max_retry_after_seconds: float = 30.0,
        system_prompt: str | None = None,
        client: ModelClient | None = None,
        history_max_messages: int = 50,
        history_max_chars: int = 32_000,
        stream: bool = True,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        max_line_bytes: int = MAX_LINE_BYTES,
        max_output_tokens: int | None = None,
        budget_endpoint: str | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self._tools = tools
        self.timeout = timeout_seconds
        self.retries = retries
        self.backoff = backoff_seconds
        self.max_retry_after = max_retry_after_seconds
        self.system_prompt = system_prompt
        self.history_max_messages = history_max_messages
        self.history_max_chars = history_max_chars
        self.stream = stream
        self.max_response_bytes = max_response_bytes
        self.max_line_bytes = max_line_bytes
        # The request's bound on the answer (`max_tokens`; None: the endpoint's own), and what
        # a call reserves of its endpoint's budget beyond its prompt.
        self.max_output_tokens = max_output_tokens
        # The key of this agent's budget (docs/model-budgets.md): its model at its base URL,
        # or the name the operator gave.
        self.budget_endpoint = budget_endpoint or endpoint_key(base_url, model)
        # Clients shared by the process: connections to the endpoint are reused across runs.
        self._client = client

    # --- the decision -------------------------------------------------------------------------
    async def decide(self, state: RunState) -> Decision:
        turns: list[dict[str, JSON]] = state.agent.setdefault("turns", [])
        self._adopt_orphan_calls(state, turns)
        self._take_answer(state, turns)
        unfinished = self._unfinished_calls(state, turns)
        if unfinished:
            return unfinished
        deferred = self._deferred_question(state, turns)
        if deferred is not None:
            return deferred
        with tracing.model_call(
            "openai", "chat", self.model_of(state), urlsplit(self.url).hostname or ""
        ) as span:
            reply = await self._complete(self._messages(state, turns), state)
            span.set(_genai_attributes(reply))
        usage = reply.get("usage") or {}
        totals = state.agent.setdefault(
            "usage", {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        )
        for field_name in totals:
            value = usage.get(field_name)
            if isinstance(value, int):
                totals[field_name] += value
        message = self._message_of(reply)
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if state.output is not None and state.output.partial:
            # The streamed text, whole and durable, before the tool calls or the run's end it
            # precedes. An answer that was not streamed has no live text to complete: its text
            # is in the run's result (or its turn), as before, at no extra write.
            await state.output.complete(content if isinstance(content, str) else None)
        if not calls:
            return Finish(
                {
                    "final": message.get("content"),
                    "usage": totals,
                    "tool_outcomes": [
                        {"step": t.step, "tool": t.tool, "status": t.status, "outcome": t.outcome}
                        for t in state.tools
                    ],
                    "answers": state.answers,
                }
            )
        return self._plan(state, turns, message, calls)

    def _plan(
        self,
        state: RunState,
        turns: list[dict[str, JSON]],
        message: dict[str, JSON],
        calls: list[JSON],
    ) -> Decision:
        known = self._tools()
        planned: list[dict[str, JSON]] = []
        actions: list[CallTool] = []
        ask: Ask | None = None
        step = state.next_step
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                raise AgentError(
                    f"malformed tool call from the endpoint: {call!r:.300}", permanent=True
                )
            name = call["function"].get("name")
            raw = call["function"].get("arguments") or "{}"
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                raise AgentError(
                    f"the endpoint sent tool arguments that are not JSON: {raw!r:.300}",
                    permanent=True,
                ) from None
            if not isinstance(args, dict):
                raise AgentError(
                    f"tool arguments must be an object, got {raw!r:.300}", permanent=True
                )
            call_id = str(call.get("id") or f"call_{step}")
            if name == ASK_USER:
                if ask is not None:
                    raise AgentError("the model asked the user twice at once", permanent=True)
                ask = Ask(args.get("question", args))
                planned.append(
                    {
                        "id": call_id,
                        "name": ASK_USER,
                        "arguments": raw,
                        "ask_index": len(state.answers),
                        "question": ask.question,
                    }
                )
                continue
            if name not in known:
                raise AgentError(f"the endpoint called an unknown tool {name!r}", permanent=True)
            planned.append(
                {"id": call_id, "name": name, "arguments": raw, "args": args, "step": step}
            )
            actions.append(CallTool(tool=str(name), args=args))
            step += 1
        turns.append({"content": message.get("content"), "calls": planned})
        if actions:
            # Tools first; a question in the same turn is asked once their results are in.
            return actions
        assert ask is not None
        return ask

    # --- rebuilding the conversation ----------------------------------------------------------
    @staticmethod
    def _adopt_orphan_calls(state: RunState, turns: list[dict[str, JSON]]) -> None:
        """Give a turn to recorded tool calls no turn mentions (their turn died in a crash)."""
        mentioned = {c.get("step") for t in turns for c in t["calls"]}
        for record in state.tools:
            if record.step not in mentioned:
                turns.append(
                    {
                        "content": None,
                        "calls": [
                            {
                                "id": f"call_step_{record.step}",
                                "name": record.tool,
                                "arguments": json.dumps(record.args),
                                "step": record.step,
                            }
                        ],
                    }
                )

    @staticmethod
    def _take_answer(state: RunState, turns: list[dict[str, JSON]]) -> None:
        pending = [
            c
            for t in turns
            for c in t["calls"]
            if c["name"] == ASK_USER and c["ask_index"] >= len(state.answers)
        ]
        if pending and state.unconsumed_inputs:
            state.answers.append(state.unconsumed_inputs[0])

    @staticmethod
    def _unfinished_calls(state: RunState, turns: list[dict[str, JSON]]) -> list[CallTool]:
        """Calls of the last turn that never started (the worker stopped between two calls of
        one response): run them, in order, under the steps the turn planned for them, before
        asking the model anything; never give their step numbers to a new call."""
        if not turns:
            return []
        steps = {t.step for t in state.tools}
        remaining = [
            c for c in turns[-1]["calls"] if c["name"] != ASK_USER and c["step"] not in steps
        ]
        if not remaining:
            return []
        assert remaining[0]["step"] == state.next_step, "calls run in order"
        return [
            CallTool(tool=str(c["name"]), args=dict(c.get("args") or json.loads(c["arguments"])))
            for c in remaining
        ]

    @staticmethod
    def _deferred_question(state: RunState, turns: list[dict[str, JSON]]) -> Ask | None:
        """A question the model asked beside tool calls, due once their results are in."""
        if not turns or state.unconsumed_inputs:
            return None
        calls = turns[-1]["calls"]
        steps = {t.step for t in state.tools}
        tools_done = all(c["step"] in steps for c in calls if c["name"] != ASK_USER)
        for call in calls:
            if tools_done and call["name"] == ASK_USER and call["ask_index"] >= len(state.answers):
                return Ask(call.get("question"))
        return None

    def model_of(self, state: RunState) -> str:
        """The upstream model of this run: its first input's `upstream_model` (a string, as the
        Responses API's `model: "openai:<model>"` arrives), else the service's."""
        first = state.inputs[0] if state.inputs else None
        chosen = first.get("upstream_model") if isinstance(first, dict) else None
        return chosen if isinstance(chosen, str) and chosen else self.model

    def _messages(self, state: RunState, turns: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        messages: list[dict[str, JSON]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        first = state.inputs[0] if state.inputs else ""
        # The caller's own instructions (the Responses API's `instructions`), after the
        # service's prompt: a system message of this run only, never of the session's history.
        instructions = first.get("instructions") if isinstance(first, dict) else None
        if isinstance(instructions, str) and instructions:
            messages.append({"role": "system", "content": instructions})
        messages.extend(
            trim_history(
                chat_messages(state.history),
                max_messages=self.history_max_messages,
                max_chars=self.history_max_chars,
            )
        )
        text = first.get("text") if isinstance(first, dict) and "text" in first else first
        messages.append(
            {"role": "user", "content": text if isinstance(text, str) else json.dumps(text)}
        )
        by_step = {t.step: t for t in state.tools}
        # Steered input (docs/turn-control.md): a user message where the run took it, before
        # the first turn whose calls came after it (never between a call and its result).
        steered = list(state.steered)
        for turn in turns:
            answered = [c for c in turn["calls"] if self._result(c, by_step, state) is not None]
            if not answered:
                continue  # nothing of this turn happened (or it is still in progress)
            steps = [int(c["step"]) for c in turn["calls"] if c.get("step") is not None]
            first_step = min(steps) if steps else None
            while steered and first_step is not None and int(steered[0]["at_step"]) <= first_step:
                messages.append(_user_message(steered.pop(0)["input"]))
            messages.append(
                {
                    "role": "assistant",
                    "content": turn.get("content"),
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in answered
                    ],
                }
            )
            for call in answered:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": self._result(call, by_step, state),
                    }
                )
        messages.extend(_user_message(entry["input"]) for entry in steered)
        return messages

    @staticmethod
    def _result(call: dict[str, JSON], by_step: dict[int, Any], state: RunState) -> str | None:
        if call["name"] == ASK_USER:
            index = call["ask_index"]
            if index < len(state.answers):
                answer = state.answers[index]
                return answer if isinstance(answer, str) else json.dumps(answer)
            return None
        record = by_step.get(int(call.get("step", 0)))
        if record is None:
            return None
        if record.status == "uncertain":
            return json.dumps({"status": "unknown", "message": UNKNOWN})
        result: dict[str, JSON] = {"status": record.status, "result": record.outcome}
        if record.args != call.get("args", record.args):
            # The user edited the arguments before approving the call (docs/approvals.md).
            result["arguments_edited_by_user"] = record.args
        return json.dumps(result)

    # --- the endpoint -------------------------------------------------------------------------
    def _tool_schema(self) -> list[dict[str, JSON]]:
        schema = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                },
            }
            for tool in self._tools().values()
        ]
        schema.append(
            {
                "type": "function",
                "function": {
                    "name": ASK_USER,
                    "description": "Ask the user a question and wait for the answer.",
                    "parameters": {
                        "type": "object",
                        "properties": {"question": {"type": "string"}},
                        "required": ["question"],
                    },
                },
            }
        )
        return schema

    async def _complete(
        self, messages: list[dict[str, JSON]], state: RunState | None = None
    ) -> dict[str, JSON]:
        body: dict[str, JSON] = {
            "model": self.model if state is None else self.model_of(state),
            "messages": messages,
            "tools": self._tool_schema(),
        }
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        payload = _encode(body)
        output = state.output if state is not None else None
        capacity = state.capacity if state is not None else None
        # One request and the call's estimated tokens, reserved before each sending.
        estimate = estimate_tokens(
            len(payload),
            OUTPUT_ESTIMATE_TOKENS if self.max_output_tokens is None else self.max_output_tokens,
        )
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        client = self._client or ModelClient(1)
        attempt = 0
        try:
            while True:
                attempt += 1
                wait = self.backoff * 2 ** (attempt - 1)
                reservation: Reservation | None = None
                if capacity is not None:
                    # No room raises CapacityWait: the run gives its slot back until there is.
                    reservation = await capacity.reserve(self.budget_endpoint, estimate)
                # What the provider spent, as far as this side can tell: the estimate, unless
                # it reports its usage, or refused the call (429).
                spent = estimate
                refused = False
                try:
                    answer = await self._attempt(client, payload, headers, output)
                except TimeoutError:
                    problem = f"the endpoint did not answer within {self.timeout:g}s"
                except aiohttp.ClientError as exc:
                    problem = f"cannot reach the endpoint: {type(exc).__name__}"
                except TooLarge as exc:
                    raise AgentError(str(exc), permanent=True) from None
                else:
                    status, retry_after, text, reply, limits = answer
                    if capacity is not None and limits.said():
                        # What the provider allows, for every process's next reservation.
                        await capacity.observe(self.budget_endpoint, limits)
                    if status == 429:
                        spent, refused = 0, True
                    elif reply is not None:
                        spent = _used_tokens(reply, estimate)
                    if status == 429 or status >= 500:
                        problem = f"the endpoint answered {status}: " + self._excerpt(text)
                        wait = max(wait, _retry_after(retry_after, self.max_retry_after))
                    elif status >= 400:
                        raise AgentError(
                            f"the endpoint answered {status}: " + self._excerpt(text),
                            permanent=True,
                        )
                    else:
                        assert reply is not None
                        return reply
                finally:
                    if capacity is not None and reservation is not None:
                        await capacity.settle(reservation, spent)
                if output is not None:
                    output.restart()  # what this attempt showed is void; the next starts over
                if capacity is not None and refused:
                    # The provider's limit, not this run's: every process waits it out (the
                    # next reservation finds the pause and gives the run's slot back), none
                    # retries alone.
                    await capacity.pause(self.budget_endpoint, wait)
                    if attempt <= self.retries:
                        continue
                if attempt > self.retries:
                    raise AgentError(f"{problem} (after {attempt} attempts)", permanent=False)
                log.info(
                    "chat completion failed; retrying",
                    extra={"attempt": attempt, "retry_in": wait, "problem": problem},
                )
                await asyncio.sleep(wait)
        finally:
            if self._client is None:
                await client.aclose()

    async def _attempt(
        self,
        client: ModelClient,
        payload: bytes,
        headers: dict[str, str],
        output: LiveOutput | None,
    ) -> tuple[int, str | None, str, dict[str, JSON] | None, ProviderLimits]:
        """One request: its status, Retry-After, the text of a failed answer (for its excerpt),
        the reply (None when the status says it failed) and what its rate-limit headers said.
        Every read is bounded (app/runtime/outbound.py); a connection whose answer was not read
        to its end is closed, never reused."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeout, sock_read=self.timeout
        )
        response = await client.session().post(
            self.url, data=payload, headers=headers, timeout=timeout, allow_redirects=False
        )
        complete = False
        try:
            status = response.status
            limits = provider_limits(response.headers)
            if status >= 400:
                text = (await read_excerpt(response, ERROR_READ_BYTES)).decode(errors="replace")
                return status, response.headers.get("Retry-After"), text, None, limits
            if self.stream and "text/event-stream" in response.headers.get("Content-Type", ""):
                reply = await self._read_stream(response, output)
            else:
                # Streaming off, or the endpoint ignored `stream`: a plain answer.
                raw = await read_body(response, self.max_response_bytes)
                reply = self._plain_reply(raw)
            complete = True
            return status, None, "", reply, limits
        finally:
            if complete:
                response.release()  # read to its end: the connection goes back to the pool
            else:
                response.close()

    def _plain_reply(self, raw: bytes) -> dict[str, JSON]:
        try:
            reply = json.loads(raw)
        except ValueError:
            raise AgentError(
                "the endpoint's answer is not JSON: "
                + self._excerpt(raw[:ERROR_READ_BYTES].decode(errors="replace")),
                permanent=True,
            ) from None
        if not isinstance(reply, dict):
            raise AgentError("the endpoint's answer is not a JSON object", permanent=True)
        return reply

    async def _read_stream(
        self, response: aiohttp.ClientResponse, output: LiveOutput | None
    ) -> dict[str, JSON]:
        """The reply assembled from a streamed answer's chunks, read to the stream's end (so
        its connection can be reused) within the bounds."""
        assembly = _Assembly()
        done = False
        async for raw in lines(
            response, max_bytes=self.max_response_bytes, max_line=self.max_line_bytes
        ):
            if done or not raw.startswith(b"data:"):
                continue  # comments, event names, blank separators, whatever follows [DONE]
            data = raw[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                raise AgentError(
                    "the endpoint streamed a chunk that is not JSON: "
                    + self._excerpt(data.decode(errors="replace")),
                    permanent=True,
                ) from None
            if not isinstance(chunk, dict):
                raise AgentError(
                    "the endpoint streamed a chunk that is not an object", permanent=True
                )
            text = assembly.add(chunk)
            if text and output is not None:
                output.delta(text)
        return assembly.reply()

    def _excerpt(self, text: str, limit: int = EXCERPT_CHARS) -> str:
        """What the endpoint said, for a failure the tenant sees: the configured key redacted
        first (an endpoint may echo it back), then cut short, so no part of it survives."""
        if self._api_key:
            text = text.replace(self._api_key, "[redacted]")
        return text[:limit].replace("\n", " ")

    def _message_of(self, reply: dict[str, JSON]) -> dict[str, JSON]:
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise AgentError(
                f"the endpoint's answer has no choices: {self._excerpt(str(reply), 300)}",
                permanent=True,
            )
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise AgentError(
                f"the endpoint's answer has no message: {self._excerpt(str(reply), 300)}",
                permanent=True,
            )
        return message


def _encode(body: dict[str, JSON]) -> bytes:
    """The request body: orjson (the json module's encoder was 9 % of a 2,000-slot worker's
    CPU); the json module for what orjson refuses (integers beyond 64 bits in a tool's
    result, which JSON itself allows)."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _used_tokens(reply: dict[str, JSON], estimate: int) -> int:
    """The tokens the provider reports the call used (input and output, as it counts them),
    or the estimate when it reports none."""
    usage = reply.get("usage")
    if isinstance(usage, dict):
        total = usage.get("total_tokens")
        if isinstance(total, int) and total >= 0:
            return total
        parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        if all(isinstance(p, int) and p >= 0 for p in parts):
            return sum(p for p in parts if isinstance(p, int))
    return estimate


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def reset_seconds(value: str | None) -> float | None:
    """A rate-limit reset time as OpenAI writes it (`1m2.5s`, `6ms`, `20s`; a bare number is
    seconds), in seconds; None when it is not one."""
    if value is None:
        return None
    text = value.strip()
    try:
        return max(float(text), 0.0)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def provider_limits(headers: Mapping[str, str]) -> ProviderLimits:
    """What an answer's rate-limit headers say (x-ratelimit-limit-, -remaining- and -reset-,
    of requests and tokens, as OpenAI sends them). A limit not sent is inferred from what
    remains and when the bucket is full again, when that is under a minute (a bucket refills
    at its limit a minute: limit = remaining / (1 - reset / 60))."""

    def number(name: str) -> float | None:
        raw = headers.get(name)
        try:
            value = float(raw) if raw is not None else None
        except ValueError:
            return None
        return value if value is not None and value >= 0 else None

    found: dict[str, float | None] = {}
    for kind in ("requests", "tokens"):
        limit = number(f"x-ratelimit-limit-{kind}")
        remaining = number(f"x-ratelimit-remaining-{kind}")
        reset = reset_seconds(headers.get(f"x-ratelimit-reset-{kind}"))
        if limit is None and remaining is not None and reset is not None and 0 < reset < 60:
            limit = remaining / (1 - reset / 60)
        found[f"limit_{kind}"] = limit
        found[f"remaining_{kind}"] = remaining
    return ProviderLimits(
        limit_requests=None if found["limit_requests"] is None else round(found["limit_requests"]),
        limit_tokens=None if found["limit_tokens"] is None else round(found["limit_tokens"]),
        remaining_requests=found["remaining_requests"],
        remaining_tokens=found["remaining_tokens"],
    )


def _retry_after(value: str | None, ceiling: float) -> float:
    if value is None:
        return 0.0
    try:
        return min(max(float(value), 0.0), ceiling)
    except ValueError:
        return 0.0


def _genai_attributes(reply: dict[str, JSON]) -> dict[str, tracing.AttributeValue | None]:
    """The GenAI semantic conventions' response attributes of one chat completion."""
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    choices = reply.get("choices")
    reasons = [
        str(c["finish_reason"])
        for c in (choices if isinstance(choices, list) else [])
        if isinstance(c, dict) and c.get("finish_reason")
    ]

    def tokens(name: str) -> int | None:
        value = usage.get(name)
        return value if isinstance(value, int) else None

    return {
        "gen_ai.response.model": str(reply["model"]) if reply.get("model") else None,
        "gen_ai.response.id": str(reply["id"]) if reply.get("id") else None,
        "gen_ai.response.finish_reasons": tuple(reasons) if reasons else None,
        "gen_ai.usage.input_tokens": tokens("prompt_tokens"),
        "gen_ai.usage.output_tokens": tokens("completion_tokens"),
    }


class _Assembly:
    """A streamed chat completion put back together: the text, the tool calls from their
    fragments (by `index`: the first fragment names the call, the rest add to its arguments),
    the finish reason, the usage (the last chunk's, with `include_usage`), id and model."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: JSON = None
        self.id: str | None = None
        self.model: str | None = None

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one chunk; the text it adds to the message."""
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return ""
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        for fragment in delta.get("tool_calls") or []:
            if not isinstance(fragment, dict):
                raise AgentError(f"malformed tool call fragment: {fragment!r:.300}", permanent=True)
            index = int(fragment.get("index", len(self.calls)))
            call = self.calls.setdefault(
                index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if fragment.get("id"):
                call["id"] = fragment["id"]
            function = fragment.get("function")
            if isinstance(function, dict):
                if function.get("name"):
                    call["function"]["name"] += str(function["name"])
                if function.get("arguments"):
                    call["function"]["arguments"] += str(function["arguments"])
        text = delta.get("content")
        if isinstance(text, str) and text:
            self.content.append(text)
            return text
        return ""

    def reply(self) -> dict[str, JSON]:
        message: dict[str, JSON] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content else None,
        }
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        reply: dict[str, JSON] = {
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}]
        }
        if self.usage is not None:
            reply["usage"] = self.usage
        if self.id:
            reply["id"] = self.id
        if self.model:
            reply["model"] = self.model
        return reply


def _user_message(value: JSON) -> dict[str, JSON]:
    """A user's input as a chat message: its text, or the JSON itself."""
    text = value.get("text") if isinstance(value, dict) and "text" in value else value
    return {"role": "user", "content": text if isinstance(text, str) else json.dumps(text)}
