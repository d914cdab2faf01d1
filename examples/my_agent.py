"""Your own agent in twenty lines: it asks the user's name, calls a tool, and answers.
From this folder: TURNSTILE_PLUGINS=my_agent:register turnstile serve (docs/runtime.md)."""

from app.runtime.agents import Ask, CallTool, Decision, Finish
from app.runtime.executor import Registry
from app.runtime.state import RunState


class GreeterAgent:
    name = "greeter"
    time_limit_seconds: float | None = 60

    async def decide(self, state: RunState) -> Decision:
        # Deterministic given the state: a recovered run replays it from its checkpoint.
        if not state.unconsumed_inputs and not state.answers:
            return Ask("What is your name?")  # the run waits; the user's next turn answers
        if not state.answers:
            state.answers.append(state.unconsumed_inputs[0])
        if not state.tools:  # `echo` is built in; your own tools go in registry.tools
            return [CallTool("echo", {"greeting": f"Hello, {state.answers[0]}!"})]
        return Finish(state.tools[0].outcome)


def register(registry: Registry) -> None:
    registry.agents["greeter"] = GreeterAgent()
