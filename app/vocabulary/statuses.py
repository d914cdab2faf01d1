"""The run statuses, defined once: the API's models, its query parameters, the dashboard's
filters, the CLI's tables, the metrics and the schema's constraints all derive from these."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A run's status, lower case on the wire. The first three hold the session's one active
    slot (the partial unique index); the last three are final."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING_FOR_USER = "waiting_for_user"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE: tuple[RunStatus, ...] = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_FOR_USER)
TERMINAL: tuple[RunStatus, ...] = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
ALL: tuple[RunStatus, ...] = (*ACTIVE, *TERMINAL)


def sql_list(statuses: tuple[RunStatus, ...]) -> str:
    """`'queued', 'running', ...`: for constraints and index predicates written from Python."""
    return ", ".join(f"'{status.value}'" for status in statuses)
