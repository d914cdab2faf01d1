"""The queue core: ADR-0004's claim, fenced transitions, sweeper and idempotency.

It knows nothing of HTTP, the runtime or the worker pool; they call it. Its SQL is in
`queries.sql` beside this file.
"""
