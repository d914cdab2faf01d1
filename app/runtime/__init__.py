"""The runtime: what a worker does once it holds a run (ADR-0004 decisions 7 and 8).

Agents decide the next action from the run's state; tools act, each with a declared
idempotency class; the executor journals every tool call before it runs, records its outcome
with a checkpoint after, resumes a reclaimed run from its last checkpoint, and turns an unsafe
call with no recorded outcome into `uncertain`. It writes only through the queue core's fenced
statements.
"""
