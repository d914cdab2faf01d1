"""Live output deltas: the pieces of a model's message while it is being written, carried by
NOTIFY on their own channel and never stored (docs/adr/0007-live-output-deltas.md).

A delta names its run, the run's session (or None), the claim that produced it (`epoch`), the
message it belongs to (`message`: the count of `message.completed` events that claim wrote
before it) and where its text goes in that message (`offset`, in characters: Unicode code
points). The durable `message.completed` event, written under the fence, is the authoritative
text; deltas only show it early.

Wire format (channel `turnstile_deltas`): `{"d": [[run_id, session_id, epoch, message, offset,
text], ...]}`, compact JSON, at most `MAX_PAYLOAD_BYTES` once encoded in UTF-8 (`pack` cuts a
long text into pieces that fit; PostgreSQL refuses a payload of 8,000 bytes or more).

The publisher's connection is the store's (app/store/delta_channel.py); this module is the
wire format every side shares, and nothing here talks to the database.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from uuid import UUID

CHANNEL = "turnstile_deltas"
MAX_PAYLOAD_BYTES = 4_000


@dataclass(frozen=True)
class Delta:
    run_id: UUID
    session_id: UUID | None
    epoch: int
    message: int
    offset: int
    text: str

    @property
    def end(self) -> int:
        return self.offset + len(self.text)

    def row(self) -> list[object]:
        return [
            str(self.run_id),
            str(self.session_id) if self.session_id else None,
            self.epoch,
            self.message,
            self.offset,
            self.text,
        ]

    def follows(self, other: Delta) -> bool:
        """This piece continues `other` directly (same message of the same claim)."""
        return (
            self.run_id == other.run_id
            and self.epoch == other.epoch
            and self.message == other.message
            and self.offset == other.end
        )


def _encoded(rows: list[list[object]]) -> int:
    return len(json.dumps({"d": rows}, separators=(",", ":"), ensure_ascii=False).encode())


def pack(deltas: list[Delta], limit: int = MAX_PAYLOAD_BYTES) -> tuple[str, list[Delta]]:
    """One payload of at most `limit` bytes from the head of `deltas`, contiguous pieces of one
    message merged; returns it and what did not fit (a delta cut in two leaves its tail, with
    its offset moved on). The payload holds at least one character whenever `deltas` has one."""
    merged: list[Delta] = []
    for delta in deltas:
        if merged and delta.follows(merged[-1]):
            merged[-1] = replace(merged[-1], text=merged[-1].text + delta.text)
        else:
            merged.append(delta)
    rows: list[list[object]] = []
    for index, delta in enumerate(merged):
        if _encoded([*rows, delta.row()]) <= limit:
            rows.append(delta.row())
            continue
        # The longest head of this text that still fits (escaping makes bytes per character
        # vary: search instead of dividing).
        low, high = 0, len(delta.text)
        while low < high:
            middle = (low + high + 1) // 2
            head = replace(delta, text=delta.text[:middle])
            if _encoded([*rows, head.row()]) <= limit:
                low = middle
            else:
                high = middle - 1
        rest = merged[index:]
        if low > 0:
            rows.append(replace(delta, text=delta.text[:low]).row())
            rest = [
                replace(delta, offset=delta.offset + low, text=delta.text[low:]),
                *merged[index + 1 :],
            ]
        payload = json.dumps({"d": rows}, separators=(",", ":"), ensure_ascii=False)
        return payload, rest
    return json.dumps({"d": rows}, separators=(",", ":"), ensure_ascii=False), []


def unpack(payload: str) -> list[Delta]:
    """The deltas of one notification; a malformed one gives none (a listener never fails on
    what another process sent)."""
    try:
        rows = json.loads(payload)["d"]
        return [
            Delta(
                run_id=UUID(str(row[0])),
                session_id=UUID(str(row[1])) if row[1] else None,
                epoch=int(row[2]),
                message=int(row[3]),
                offset=int(row[4]),
                text=str(row[5]),
            )
            for row in rows
        ]
    except (ValueError, KeyError, TypeError, IndexError):
        return []
