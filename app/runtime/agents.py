"""Agents: given a run's state, the next action (call tools, ask the user, or finish).

`ScriptedAgent` is deterministic and driven by the turn's input:

    {"script": [{"call": "sleep", "args": {"seconds": 0.2}},
                {"call": "http_request", "args": {...}, "idempotency_key": true},
                {"ask": "Which account?"},
                {"say": "Here is what I found.", "pieces": 5, "delay": 0.05},
                {"final": "done"}]}

It is what the demo, the tests and the benchmarks use. Its result lists every tool outcome it
saw (`uncertain` included) and the answers it received. An input without a script finishes at
once, answering with the input. A `say` step writes its text live, in `pieces` parts (default:
one per word) `delay` seconds apart (default 0.02), then ends it as a durable
`message.completed`; a script whose last step is a `say` finishes with that text as its final
message. With `"echo_history": true` in the input, the result also
shows the session history the run was given (`history`: role, kind, content and run number of
each entry), which is how tests and demos see what an agent receives.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from app.runtime.state import RunState
from app.vocabulary.records import JSON


@dataclass(frozen=True)
class CallTool:
    tool: str
    args: dict[str, JSON] = field(default_factory=dict)


@dataclass(frozen=True)
class Ask:
    question: JSON


@dataclass(frozen=True)
class Finish:
    result: JSON


Decision = list[CallTool] | Ask | Finish


class AgentError(Exception):
    """The agent cannot continue; `permanent` errors fail the run, others are retried."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def unknown_agent(name: str, known: Iterable[str]) -> str:
    """Why a run cannot name this agent, and, for the built-in one left unconfigured, the
    setting that enables it."""
    text = f"unknown agent {name!r} (known: {', '.join(sorted(known))})"
    if name == "openai":
        text += (
            "; the 'openai' agent is enabled by setting TURNSTILE_OPENAI_BASE_URL on the server "
            "(an OpenAI-compatible endpoint, e.g. https://api.openai.com/v1)"
        )
    return text


class Agent(Protocol):
    name: str
    time_limit_seconds: float | None  # execution time while claimed; None: the default

    async def decide(self, state: RunState) -> Decision: ...


class ScriptedAgent:
    name = "scripted"
    time_limit_seconds: float | None = None

    async def decide(self, state: RunState) -> Decision:
        first = state.inputs[0] if state.inputs else None
        script = first.get("script") if isinstance(first, dict) else None
        if script is None:
            return Finish(self._result(first, state))
        if not isinstance(script, list):
            raise AgentError("input.script must be a list of steps", permanent=True)
        cursor = int(state.agent.get("cursor", 0))
        while True:
            # Tool outcomes, answers and said messages advance the cursor; recompute it from
            # the state so a checkpoint written at any boundary resumes at the right item.
            cursor = self._advance(script, cursor, state)
            if cursor >= len(script):
                last = script[-1] if script else None
                said = last.get("say") if isinstance(last, dict) else None
                return Finish(self._result(said, state))
            item = script[cursor]
            if not isinstance(item, dict):
                raise AgentError(f"script step {cursor} must be an object", permanent=True)
            if "say" not in item:
                break
            await self._say(item, state)
            state.agent["said"] = int(state.agent.get("said", 0)) + 1
        if "call" in item:
            args = dict(item.get("args") or {})
            if item.get("idempotency_key"):
                args["idempotency_key"] = True
            return [CallTool(tool=str(item["call"]), args=args)]
        if "ask" in item:
            return Ask(item["ask"])
        if "final" in item:
            return Finish(self._result(item["final"], state))
        raise AgentError(f"script step {cursor} has none of call, ask, say, final", permanent=True)

    @staticmethod
    async def _say(item: dict[str, JSON], state: RunState) -> None:
        text = item.get("say")
        if not isinstance(text, str):
            raise AgentError("a say step's text must be a string", permanent=True)
        pieces = _pieces(text, item.get("pieces"))
        delay = item.get("delay", 0.02)
        if not isinstance(delay, int | float) or not 0 <= delay <= 10:
            raise AgentError("a say step's delay must be 0 to 10 seconds", permanent=True)
        output = state.output
        for index, piece in enumerate(pieces):
            if index and delay:
                await asyncio.sleep(float(delay))
            if output is not None:
                output.delta(piece)
        if output is not None:
            await output.complete(text)

    def _advance(self, script: list[JSON], cursor: int, state: RunState) -> int:
        calls_done = len(state.tools)
        answers = len(state.answers)
        said = int(state.agent.get("said", 0))
        position = calls_seen = asks_seen = says_seen = 0
        for position, item in enumerate(script):  # noqa: B007
            if not isinstance(item, dict):
                break
            if "call" in item:
                if calls_seen == calls_done:
                    break
                calls_seen += 1
            elif "ask" in item:
                if asks_seen == answers:
                    # A delivered answer not yet consumed: take it and move past the question.
                    if state.unconsumed_inputs:
                        state.answers.append(state.unconsumed_inputs[0])
                        answers += 1
                        asks_seen += 1
                        continue
                    break
                asks_seen += 1
            elif "say" in item:
                if says_seen == said:
                    break
                says_seen += 1
            else:
                break
        else:
            position = len(script)
        state.agent["cursor"] = position
        return position

    @staticmethod
    def _result(final: JSON, state: RunState) -> JSON:
        result: dict[str, JSON] = {
            "final": final,
            "tool_outcomes": [
                {"step": t.step, "tool": t.tool, "status": t.status, "outcome": t.outcome}
                for t in state.tools
            ],
            "answers": state.answers,
        }
        if state.steered:
            # Input steered into the run while it worked (docs/turn-control.md), in order.
            result["steered"] = [entry["input"] for entry in state.steered]
        first = state.inputs[0] if state.inputs else None
        if isinstance(first, dict) and first.get("echo_history"):
            result["history"] = [
                {
                    "run_no": entry["run_no"],
                    "role": entry["role"],
                    "kind": entry["kind"],
                    "content": entry["content"],
                }
                for entry in state.history
            ]
        return result


def _pieces(text: str, count: JSON) -> list[str]:
    """`text` cut into `count` parts of about the same length (None: one part per word, each
    with the spaces after it); their concatenation is `text`."""
    if count is None:
        return re.findall(r"\S+\s*|\s+", text) or [text]
    if not isinstance(count, int) or count < 1:
        raise AgentError("a say step's pieces must be a positive integer", permanent=True)
    size = max(1, -(-len(text) // count))
    return [text[i : i + size] for i in range(0, len(text), size)] or [text]
