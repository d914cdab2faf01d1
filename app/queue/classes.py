"""Priority classes. Each class owns a band of ten priorities (interactive 0-9, async 10-19,
maintenance 20-29) and runs are created at the band's base value; a class can be subdivided
later without a migration because the schema's CHECK is a range."""

from __future__ import annotations

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
