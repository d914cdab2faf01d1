"""A run's state as the runtime checkpoints it: the inputs it has seen, the outcome of every
tool call, the answers it received, and whatever the agent keeps for itself. Plain JSON, so a
checkpoint is one JSONB value.

A run of a session also carries its history: the transcript of the session's earlier runs
(`history`, entries as `GET /sessions/{id}/messages` lists them). The checkpoint keeps only
where that history starts and ends (`history_window`, run numbers within the session), never
the history itself: checkpoints have a size cap, and the runs in the window are all finished,
so a recovered run reads the same history back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from app.vocabulary.records import JSON

if TYPE_CHECKING:
    from app.runtime.capacity import ModelCapacity
    from app.runtime.live import LiveOutput
    from app.vocabulary.approval_policy import ApprovalPolicy

# `rejected`: the user refused the call before it ran (docs/approvals.md); it never ran.
OutcomeStatus = Literal["succeeded", "failed", "uncertain", "rejected"]


@dataclass
class ToolRecord:
    step: int
    tool: str
    args: JSON
    idempotency_class: str
    status: OutcomeStatus
    outcome: JSON

    def to_json(self) -> dict[str, JSON]:
        return {
            "step": self.step,
            "tool": self.tool,
            "args": self.args,
            "idempotency_class": self.idempotency_class,
            "status": self.status,
            "outcome": self.outcome,
        }


@dataclass
class RunState:
    inputs: list[JSON]
    tools: list[ToolRecord] = field(default_factory=list)
    answers: list[JSON] = field(default_factory=list)
    questions: list[JSON] = field(default_factory=list)
    agent: dict[str, JSON] = field(default_factory=dict)  # the agent's own bookkeeping
    elapsed_seconds: float = 0.0  # execution time while claimed, across claims
    # The session's runs this run's history covers: {"from_run_no", "through_run_no"}
    # (through < from: none). Checkpointed; `history` is read back from it at every claim.
    history_window: dict[str, int] | None = None
    # The transcript entries of that window, oldest first (not checkpointed).
    history: list[dict[str, JSON]] = field(default_factory=list)
    # Steered turns the run took (docs/turn-control.md), in order: {"input", "at_step"} (the
    # step the run was at: where the agent's conversation places it). Not checkpointed: the
    # executor reads them back at every claim, so one taken after the checkpoint is kept.
    steered: list[dict[str, JSON]] = field(default_factory=list)
    # Approval before a tool call (docs/approvals.md): the decisions the run took, in order
    # ({"call_id", "decision", "args", "reason"}; each was one of its inputs), and the request
    # it waits for (or None). Checkpointed: the waiting checkpoint names the call, so the
    # input delivered next is its decision, whichever worker resumes the run.
    approvals: list[dict[str, JSON]] = field(default_factory=list)
    pending_approval: dict[str, JSON] | None = None
    # Where the agent writes its message live (app/runtime/live.py); set by the executor for
    # each execution, never checkpointed.
    output: LiveOutput | None = field(default=None, repr=False, compare=False)
    # Where the agent reserves model capacity before each call (app/runtime/capacity.py); set
    # by the executor when model budgets are on, never checkpointed.
    capacity: ModelCapacity | None = field(default=None, repr=False, compare=False)
    # The approval policy this execution works under (docs/approvals.md), read by the
    # executor at the execution's first tool call; never checkpointed.
    approval_policy: ApprovalPolicy | None = field(default=None, repr=False, compare=False)

    @property
    def next_step(self) -> int:
        return len(self.tools) + 1

    @property
    def unconsumed_inputs(self) -> list[JSON]:
        """Inputs delivered after the first that no question has consumed yet (answers); the
        approvals the runtime took are not answers."""
        return self.inputs[1 + len(self.answers) + len(self.approvals) :]

    def take_approval(self) -> None:
        """The decision delivered for the call this run waits for, taken from its inputs."""
        pending = self.pending_approval
        if pending is None or not self.unconsumed_inputs:
            return
        value = self.unconsumed_inputs[0]
        decision = value.get("approval") if isinstance(value, dict) else None
        if isinstance(decision, dict) and decision.get("call_id") == pending.get("call_id"):
            self.approvals.append(decision)
            self.pending_approval = None

    def decision_for(self, call_id: str) -> dict[str, JSON] | None:
        for decision in self.approvals:
            if decision.get("call_id") == call_id:
                return decision
        return None

    def to_json(self) -> dict[str, JSON]:
        return {
            "inputs": self.inputs,
            "tools": [t.to_json() for t in self.tools],
            "answers": self.answers,
            "questions": self.questions,
            "agent": self.agent,
            "elapsed_seconds": round(self.elapsed_seconds, 3),
            "history_window": self.history_window,
            "approvals": self.approvals,
            "pending_approval": self.pending_approval,
        }

    @classmethod
    def from_json(cls, data: dict[str, JSON]) -> RunState:
        return cls(
            inputs=list(data["inputs"]),
            tools=[ToolRecord(**t) for t in data.get("tools", [])],
            answers=list(data.get("answers", [])),
            questions=list(data.get("questions", [])),
            agent=dict(data.get("agent", {})),
            elapsed_seconds=float(data.get("elapsed_seconds", 0.0)),
            history_window=data.get("history_window"),
            approvals=list(data.get("approvals") or []),
            pending_approval=data.get("pending_approval"),
        )
