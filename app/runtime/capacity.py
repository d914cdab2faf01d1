"""A run's hold on model capacity (docs/model-budgets.md): what an agent asks before each
model call and tells after it, through the run's `ExecutionContext` (fenced on its lease).

`ModelCapacity.reserve` takes one request and the call's estimated tokens from the endpoint's
budget, or raises `CapacityWait` when the budget has no room: the executor then gives the run
back until the budget will have it (its slot freed at once, its attempt given back). `settle`
replaces the estimate with the usage the provider reported; `pause` (a 429) stops every
process's calls to the endpoint for as long as the provider asked; `observe` passes on the
provider's rate-limit headers, which the budget's rate follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.queue.model_budgets import CapacityShort, ModelBudgets, ProviderLimits, Reservation

if TYPE_CHECKING:
    from app.worker.execution import ExecutionContext


class CapacityWait(Exception):
    """Raised by an agent that cannot reserve: end the execution with a wait for capacity."""

    def __init__(self, short: CapacityShort) -> None:
        super().__init__(short.reason())
        self.short = short


@dataclass
class ModelCapacity:
    """One execution's door to the model budgets."""

    ctx: ExecutionContext
    budgets: ModelBudgets

    async def reserve(self, endpoint: str, tokens: int) -> Reservation:
        outcome = await self.ctx.reserve_model(self.budgets, endpoint, tokens)
        if isinstance(outcome, CapacityShort):
            raise CapacityWait(outcome)
        return outcome

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        await self.ctx.settle_model(self.budgets, reservation, used_tokens)

    async def pause(self, endpoint: str, seconds: float) -> None:
        await self.ctx.pause_model(self.budgets, endpoint, seconds)

    async def observe(self, endpoint: str, limits: ProviderLimits) -> None:
        """The provider's rate-limit headers: the budget follows what it allows (no fence: it
        records what the provider said, whoever holds the run now)."""
        await self.budgets.observe(endpoint, limits)
