"""The queue core's exceptions: one root class, one subclass per outcome a caller must tell
apart. The HTTP layer maps each to a problem+json response in one place (`app/api/problems.py`);
nothing here knows about HTTP."""

from __future__ import annotations

from uuid import UUID


class TurnstileError(Exception):
    """Root of every error the core raises on purpose."""


class RunNotFoundError(TurnstileError):
    def __init__(self, run_id: UUID) -> None:
        super().__init__(f"run {run_id} not found")
        self.run_id = run_id


class SessionNotFoundError(TurnstileError):
    def __init__(self, session_id: UUID) -> None:
        super().__init__(f"session {session_id} not found")
        self.session_id = session_id


class RunFinishedError(TurnstileError):
    """The run already succeeded or failed; the requested change does not apply."""

    def __init__(self, run_id: UUID, status: str) -> None:
        super().__init__(f"run {run_id} is {status}")
        self.run_id = run_id
        self.status = status


class RunNotWaitingError(TurnstileError):
    """Input was delivered to a run that is not waiting for the user."""

    def __init__(self, run_id: UUID, status: str) -> None:
        super().__init__(f"run {run_id} is {status}, not waiting_for_user")
        self.run_id = run_id
        self.status = status
