"""Running the runtime executor by hand in tests: claim, execute (possibly 'crashing'), and
let the world recover the run the way it would after a worker died."""

from __future__ import annotations

import time
from uuid import UUID

from app.queue.core import Queue
from app.runtime.executor import RuntimeExecutor, SimulatedCrash
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Run
from app.worker.execution import DeltaSink, ExecutionContext, StopExecution
from tests.support.clock import ManualClock


async def execute_once(
    queue: Queue,
    executor: RuntimeExecutor,
    *,
    owner: str = "worker",
    deltas: DeltaSink | None = None,
) -> bool:
    """Claim the next run as worker `owner` and execute it to its next resting point (its live
    output to `deltas`); False when the execution 'crashed'."""
    claimed = await queue.claim(owner, list(PriorityClass))
    assert len(claimed) == 1
    ctx = ExecutionContext(
        queue=queue,
        claimed=claimed[0],
        slot_group="test",
        lease_seconds=30,
        trusted_until=time.monotonic() + 30,
        deltas=deltas,
    )
    try:
        await executor.execute(ctx)
    except SimulatedCrash:
        return False
    except StopExecution:
        pass  # fenced: the pool would catch this and move on
    return True


async def recover(queue: Queue, clock: ManualClock) -> None:
    """What the world does after a worker dies: its lease expires and the sweeper requeues."""
    clock.advance(31)
    report = await queue.sweep()
    assert report.requeued == 1
    clock.advance(3600)  # past any backoff


async def current(queue: Queue, run_id: UUID) -> Run:
    run = await queue.get_run(run_id)
    assert run is not None
    return run
