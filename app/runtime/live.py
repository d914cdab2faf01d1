"""A run execution's live output: the message an agent is writing, shown while it is written.

An agent writes a message through `LiveOutput` (`RunState.output`): `delta(text)` hands each
piece to the process's delta publisher (app/worker/deltas.py), which may drop it and never
blocks; `complete()` writes the durable `message.completed` event under the fence, with the
whole text, before the run's next durable event. Deltas are never stored: a crash loses them,
and the re-run's deltas carry its own epoch (docs/runtime.md says what a client does with that).

`restart()` voids the partial message (a model call retried inside the run): the next piece
starts again at offset 0 of the same message, which a client takes as "replace from here".
"""

from __future__ import annotations

from app.vocabulary.live_deltas import Delta
from app.worker.execution import ExecutionContext


class LiveOutput:
    def __init__(self, ctx: ExecutionContext) -> None:
        self._ctx = ctx
        self.message = 0  # messages this claim completed so far
        self._pieces: list[str] = []
        self._length = 0

    @property
    def partial(self) -> str:
        """The text of the message being written (not completed yet)."""
        return "".join(self._pieces)

    def delta(self, text: str) -> None:
        """One more piece of the message; shown live when the process can, never waited on."""
        if not text:
            return
        sink = self._ctx.deltas
        if sink is not None:
            run = self._ctx.claimed.run
            sink.offer(
                Delta(
                    run_id=run.id,
                    session_id=run.session_id,
                    epoch=self._ctx.lease.epoch,
                    message=self.message,
                    offset=self._length,
                    text=text,
                )
            )
        self._pieces.append(text)
        self._length += len(text)

    def restart(self) -> None:
        """Forget the partial message (its model call is being retried)."""
        self._pieces.clear()
        self._length = 0

    async def complete(self, text: str | None = None) -> str:
        """Write `message.completed` with the whole text (`text`, or the pieces given), fenced;
        the next message starts at offset 0. The publisher is given a moment (at most two of
        its ticks) to send this message's last pieces first, so a stream shows them before
        the whole text; past that the run goes on and the pieces may be dropped."""
        whole = self.partial if text is None else text
        sink = self._ctx.deltas
        if sink is not None and self._length:
            await sink.settle(self._ctx.claimed.run.id)
        await self._ctx.message_completed(whole, self.message)
        self.message += 1
        self.restart()
        return whole
