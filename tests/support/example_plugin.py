"""The example plugin of docs/runtime.md: a keyed tool and a tiny agent, registered with
`TURNSTILE_PLUGINS=tests.support.example_plugin:register`. Tests load it to keep the docs true."""

from __future__ import annotations

from typing import Any, ClassVar

from app.runtime.agents import Ask, CallTool, Decision, Finish
from app.runtime.executor import Registry
from app.runtime.state import RunState
from app.runtime.tools import IdempotencyClass, PermanentToolError, ToolContext

ORDERS: dict[str, dict[str, Any]] = {}  # stands in for a real order system


class PlaceOrderTool:
    """Places an order; the order system deduplicates by key, so repeating it is safe when the
    runtime passes the same key: the tool is `keyed`."""

    name = "place_order"
    description = "Place an order for an item; answers the order id."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"item": {"type": "string"}},
        "required": ["item"],
    }

    def idempotency_class(self, args: dict[str, Any]) -> IdempotencyClass:
        return "keyed"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        if not isinstance(args.get("item"), str):
            raise PermanentToolError("place_order needs an 'item'")
        assert ctx.idempotency_key is not None
        new = {"id": f"order-{len(ORDERS) + 1}", "item": args["item"]}
        return ORDERS.setdefault(ctx.idempotency_key, new)


class ShopAgent:
    """Asks what to buy, orders it, and reports the order."""

    name = "shop"
    time_limit_seconds: float | None = 60

    async def decide(self, state: RunState) -> Decision:
        if not state.answers and not state.unconsumed_inputs:
            return Ask("What should I order?")
        if not state.answers:
            state.answers.append(state.unconsumed_inputs[0])
        if not state.tools:
            return [CallTool("place_order", {"item": state.answers[0]})]
        return Finish({"ordered": state.tools[0].outcome, "status": state.tools[0].status})


def register(registry: Registry) -> None:
    registry.tools["place_order"] = PlaceOrderTool()
    registry.agents["shop"] = ShopAgent()
