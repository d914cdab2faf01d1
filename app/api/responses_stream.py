"""A response's Server-Sent Events in the Responses vocabulary, resumable by `sequence_number`.

`POST /v1/responses` with `stream: true` and `GET /v1/responses/{id}?stream=true` send the same
fixed sequence of events for a run (the numbering is app/protocols/openai_responses.py's:
`block_base`, `chunk_ends`); `starting_after=N` sends only the events numbered after N, so a
dropped stream picks up where it stopped, every event once and in order.

Text: the live deltas of the run's current claim (its epoch) are cut into word chunks; a chunk
goes out once its end is known. A stream that did not hear a claim's text from its first
character (it was opened, or resumed, in the middle of a message; a delta was lost) cannot count
its chunks, so it holds that text back and sends it from the run's durable final text when the
run stops: late, never out of order. A delta of an older claim than one already heard is dropped;
a newer claim closes the older claim's item (`incomplete`) and opens its own: a re-run's text
is never appended to the abandoned attempt's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.api.runs import load_run
from app.api.services import state_of
from app.api.streams import wait as stream_wait
from app.api.watch import POLL_RECHECK_SECONDS, StreamSlot, recheck_seconds
from app.protocols.openai_responses import (
    EPOCH_STRIDE,
    block_base,
    chunk_ends,
    final_text,
    message_id,
    response_document,
)
from app.security.api_keys import Caller
from app.vocabulary.live_deltas import Delta
from app.vocabulary.records import Run
from app.vocabulary.statuses import TERMINAL

# Where a response stops for its caller: finished, or asking the user.
STOPPED = {*TERMINAL, "waiting_for_user"}
END_EVENTS = {
    "completed": "response.completed",
    "failed": "response.failed",
    "cancelled": "response.failed",
    "incomplete": "response.incomplete",
}


@dataclass
class Item:
    """The output item of one claim: the text heard of its first message, and how much of it
    has gone out as chunks."""

    epoch: int
    index: int  # output_index, as this stream opened items
    message: int | None = None  # the claim's message whose text this item shows
    text: str = ""
    chunks: int = 0  # chunks sent
    sent: int = 0  # characters sent
    live: bool = True  # false once a gap or a rewrite was heard: the rest comes at the end

    @property
    def base(self) -> int:
        return block_base(self.epoch)


class ResponseStream:
    """The events of one run's response, numbered, with those up to `after` left out."""

    def __init__(self, run: Run, after: int | None, background: bool | None) -> None:
        self.run = run
        self.after = -1 if after is None else after
        self.background = background
        self.in_progress = False
        self.item: Item | None = None
        self.items = 0
        self.newest_epoch = 0

    def frame(self, number: int, kind: str, **fields: Any) -> Iterator[bytes]:
        if number <= self.after:
            return
        data = {"type": kind, "sequence_number": number, **fields}
        yield f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def item_id(self, item: Item) -> str:
        return message_id(self.run.id, item.epoch)

    def document(self, run: Run, status: str | None = None) -> dict[str, Any]:
        """The response as an event carries it; at `created` and `in_progress` without output
        (whatever the run has by now comes as items: the SDK's stream helper builds its
        snapshot from those, and refuses an item at an index it already holds)."""
        document = response_document(run, background=self.background)
        if status is not None:
            document.update(status=status, output=[], completed_at=None)
        return document

    def created(self) -> Iterator[bytes]:
        yield from self.frame(0, "response.created", response=self.document(self.run, "queued"))

    def started(self, run: Run) -> Iterator[bytes]:
        if not self.in_progress:
            self.in_progress = True
            yield from self.frame(
                1, "response.in_progress", response=self.document(run, "in_progress")
            )

    def open(self, epoch: int) -> Iterator[bytes]:
        """The item of claim `epoch`, after closing an older claim's."""
        yield from self.close("incomplete")
        item = self.item = Item(epoch=epoch, index=self.items)
        self.items += 1
        item_id = self.item_id(item)
        yield from self.frame(
            item.base,
            "response.output_item.added",
            output_index=item.index,
            item={
                "type": "message",
                "id": item_id,
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            },
        )
        yield from self.frame(
            item.base + 1,
            "response.content_part.added",
            item_id=item_id,
            output_index=item.index,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )

    def close(self, status: str) -> Iterator[bytes]:
        """An abandoned (or unfinished) claim's item ends as it stands."""
        item, self.item = self.item, None
        if item is None:
            return
        text = item.text[: item.sent]
        yield from self.frame(
            item.base + 2 + item.chunks,
            "response.output_item.done",
            output_index=item.index,
            item={
                "type": "message",
                "id": self.item_id(item),
                "role": "assistant",
                "status": status,
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            },
        )

    def chunks(self, item: Item, text: str, *, whole: bool) -> Iterator[bytes]:
        """The chunks of `text` (the item's text, heard so far or whole) not sent yet."""
        ends = chunk_ends(text, whole=whole)
        for number, end in enumerate(ends[item.chunks :], start=item.chunks):
            yield from self.frame(
                item.base + 2 + number,
                "response.output_text.delta",
                item_id=self.item_id(item),
                output_index=item.index,
                content_index=0,
                delta=text[item.sent : end],
                logprobs=[],
            )
            item.chunks, item.sent = number + 1, end

    def heard(self, delta: Delta, run: Run) -> Iterator[bytes]:
        """A live delta of this run."""
        if delta.epoch < self.newest_epoch:
            return  # an abandoned claim's late piece
        self.newest_epoch = delta.epoch
        yield from self.started(run)  # a delta is proof enough that a worker has it
        if self.item is None or self.item.epoch != delta.epoch:
            yield from self.open(delta.epoch)
        item = self.item
        assert item is not None
        if item.message is None:
            item.message = delta.message
        if delta.message != item.message or not item.live:
            return  # a later message is not a continuation: the end has the final text
        if delta.offset > len(item.text):
            item.live = False  # a gap (a lost delta, or opened mid-message): wait for the end
            return
        if item.text[delta.offset : delta.end] != delta.text[: len(item.text) - delta.offset]:
            item.live = False  # rewritten (a retried model call): the end has the final text
            return
        if delta.end > len(item.text):
            item.text = item.text[: delta.offset] + delta.text
        yield from self.chunks(item, item.text, whole=False)

    def ended(self, run: Run) -> Iterator[bytes]:
        """The run stopped: the last claim's text whole, then the response's end event."""
        if run.started_at is not None:
            yield from self.started(run)
        document = self.document(run)
        final = final_text(run.result) if run.status == "succeeded" else None
        epoch = max(run.lease_epoch, 1)
        if final is None:
            yield from self.close("incomplete")
            # The last number of that claim's block: past any chunk it wrote, and before the
            # block of the claim that an answer to its question starts.
            number = block_base(epoch) + EPOCH_STRIDE - 1
            kind = END_EVENTS.get(document["status"], "response.failed")
            yield from self.frame(number, kind, response=document)
            return
        if self.item is None or self.item.epoch != epoch:
            yield from self.open(epoch)
        item = self.item
        assert item is not None
        if final.startswith(item.text[: item.sent]):
            yield from self.chunks(item, final, whole=True)
        number = item.base + 2 + max(item.chunks, len(chunk_ends(final, whole=True)))
        item_id = self.item_id(item)
        part = {"type": "output_text", "text": final, "annotations": [], "logprobs": []}
        where = {"item_id": item_id, "output_index": item.index, "content_index": 0}
        yield from self.frame(number, "response.output_text.done", **where, text=final, logprobs=[])
        yield from self.frame(number + 1, "response.content_part.done", **where, part=part)
        done_item = document["output"][0]
        yield from self.frame(
            number + 2, "response.output_item.done", output_index=item.index, item=done_item
        )
        yield from self.frame(number + 3, "response.completed", response=document)


async def stream_events(
    request: Request,
    run: Run,
    caller: Caller,
    slot: StreamSlot,
    *,
    after: int | None = None,
    background: bool | None = None,
) -> AsyncIterator[bytes]:
    """The response's events from the run as it goes: deltas as they are heard, the run read
    again on its notifications (and on the recheck timer), the end once it stops. A stream ended
    early (the server stopping, the key revoked) just stops: the caller resumes it."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    events = ResponseStream(run, after, background)
    for frame in events.created():
        yield frame
    with (
        state.watch.watching(str(run.id)) as changed,
        state.live.following(run_id=run.id) as inbox,
    ):
        next_check = loop.time()
        while True:
            if state.shutdown.is_set() or slot.ended.is_set():
                return
            if inbox.ready.is_set():
                for delta in inbox.take():
                    if delta.run_id == run.id:
                        for frame in events.heard(delta, run):
                            yield frame
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()
                run = await load_run(request, run.id, caller)
                if run.status in STOPPED:
                    break
                if run.status == "running":
                    for frame in events.started(run):
                        yield frame
                next_check = loop.time() + recheck_seconds(
                    run.status, run.scheduled_for, active_seconds=POLL_RECHECK_SECONDS
                )
            await stream_wait(inbox, changed, state.shutdown, next_check - loop.time(), slot)
    for frame in events.ended(run):
        yield frame
