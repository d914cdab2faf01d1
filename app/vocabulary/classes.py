"""Priority classes. Each class owns a band of ten priorities (interactive 0-9, async 10-19,
maintenance 20-29) and runs are created at the band's base value; a class can be subdivided
later without a migration because the schema's CHECK is a range."""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum

BAND_WIDTH = 10


class PriorityClass(StrEnum):
    INTERACTIVE = "interactive"
    ASYNC = "async"
    MAINTENANCE = "maintenance"

    @property
    def base(self) -> int:
        """The priority a run of this class is created with."""
        return _BASE[self]

    @property
    def band(self) -> range:
        return range(self.base, self.base + BAND_WIDTH)

    @classmethod
    def of(cls, priority: int) -> PriorityClass:
        # A table lookup: called for every claimed and completed run (metrics, documents).
        klass = _OF_PRIORITY.get(priority)
        if klass is None:
            raise ValueError(f"priority {priority} is in no class band (0-29)")
        return klass


_BASE = {PriorityClass.INTERACTIVE: 0, PriorityClass.ASYNC: 10, PriorityClass.MAINTENANCE: 20}
_OF_PRIORITY = {p: klass for klass in PriorityClass for p in klass.band}


def priorities_of(classes: Iterable[PriorityClass]) -> list[int]:
    """Every priority value of the given classes, ascending: the claim's `:priorities`."""
    return sorted({p for klass in classes for p in klass.band})


ClassLimits = tuple[int | None, int | None, int | None]
"""A number per class, by band (interactive, async, maintenance); None for no limit."""


def parse_class_limits(spec: str) -> ClassLimits:
    """A per-class limit as people write it (TURNSTILE_TENANT_MAX_RUNNING): one number for
    every class (`4`), or `class:N` pairs (`interactive:2,async:8`; a class left out has no
    limit). Raises ValueError with a one-line reason."""
    text = spec.strip()
    if re.fullmatch(r"[0-9]{1,9}", text):
        return (int(text), int(text), int(text))
    found: dict[PriorityClass, int] = {}
    for raw in (part.strip() for part in text.split(",")):
        name, sep, count = raw.partition(":")
        if not sep or not re.fullmatch(r"[0-9]{1,9}", count.strip()):
            raise ValueError(f"{raw!r} must be a number or look like 'class:N' (e.g. async:8)")
        try:
            klass = PriorityClass(name.strip())
        except ValueError:
            known = ", ".join(c.value for c in PriorityClass)
            raise ValueError(
                f"unknown class {name.strip()!r} in {raw!r} (known: {known})"
            ) from None
        if klass in found:
            raise ValueError(f"class {klass.value} given twice")
        found[klass] = int(count)
    return (
        found.get(PriorityClass.INTERACTIVE),
        found.get(PriorityClass.ASYNC),
        found.get(PriorityClass.MAINTENANCE),
    )
