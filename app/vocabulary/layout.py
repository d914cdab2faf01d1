"""Slot layouts: how many runs of which classes a process may hold at once.

Syntax: comma-separated groups, each `class[+class...]:count`, for example
`interactive:8,async:64,maintenance:1` (the default) or
`interactive:2,async+interactive:2,maintenance:1`.
A group claims among its classes by priority then age; the order classes are written in
carries no preference. The layout is refused unless every class is the highest-priority class
of at least one group: a class that only ever shares slots with a higher class can starve
under sustained load of that higher class, which is what reserved capacity exists to prevent.

A partial layout (`partial=True`, the `TURNSTILE_PARTIAL_LAYOUT` setting; docs/adr/0005) lets a
process leave classes out, for fleets that dedicate processes to some classes (`async:32`):
the rule then holds for the classes the process serves (each heads a group of its own), and
the fleet, not the process, must cover every class; the queue's reads report a class that has
queued runs and no live slot anywhere (`Reads.live_slots`, `ClassCoverage`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.vocabulary.classes import PriorityClass


class SlotLayoutError(ValueError):
    """The slot layout setting cannot be used; the message says why."""


@dataclass(frozen=True)
class SlotGroup:
    classes: tuple[PriorityClass, ...]  # highest priority first
    size: int

    @property
    def name(self) -> str:
        return "+".join(klass.value for klass in self.classes)

    @property
    def top_class(self) -> PriorityClass:
        return self.classes[0]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "classes": [c.value for c in self.classes], "size": self.size}


def parse_slots(spec: str, *, partial: bool = False) -> tuple[SlotGroup, ...]:
    """Parse and validate a layout such as `interactive:4,async:4,maintenance:1`; with
    `partial`, a layout that serves only some classes, such as `async:32`."""
    groups: list[SlotGroup] = []
    seen: set[tuple[PriorityClass, ...]] = set()
    for raw in (part.strip() for part in spec.split(",")):
        if not raw:
            raise SlotLayoutError(f"empty slot group in {spec!r}")
        names, sep, count = raw.partition(":")
        # ASCII digits only: str.isdigit() also accepts '²', which int() refuses.
        if not sep or not re.fullmatch(r"[0-9]{1,6}", count.strip()):
            raise SlotLayoutError(f"slot group {raw!r} must look like 'class[+class]:count'")
        size = int(count)
        if size < 1:
            raise SlotLayoutError(f"slot group {raw!r} must have at least one slot")
        classes: set[PriorityClass] = set()
        for name in (n.strip() for n in names.split("+")):
            try:
                classes.add(PriorityClass(name))
            except ValueError:
                known = ", ".join(c.value for c in PriorityClass)
                raise SlotLayoutError(
                    f"unknown class {name!r} in slot group {raw!r} (known: {known})"
                ) from None
        ordered = tuple(sorted(classes, key=lambda c: c.base))
        if ordered in seen:
            raise SlotLayoutError(f"slot group {'+'.join(c.value for c in ordered)} given twice")
        seen.add(ordered)
        groups.append(SlotGroup(classes=ordered, size=size))
    tops = {group.top_class for group in groups}
    served = {klass for group in groups for klass in group.classes}
    for klass in PriorityClass:
        if klass in tops:
            continue
        if not partial:
            raise SlotLayoutError(
                f"no slot group reserves capacity for {klass.value}: every class must be the "
                f"highest-priority class of at least one group, or it can starve (a process "
                f"that serves only some classes needs a partial layout)"
            )
        if klass in served:
            # Served here only behind a higher class: it can starve in this process, and the
            # fleet's coverage check would count these slots as serving it.
            raise SlotLayoutError(
                f"{klass.value} is served only in groups headed by a higher class: a class a "
                f"partial layout serves must head a group of its own, or be left out"
            )
    return tuple(groups)
