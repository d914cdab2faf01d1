"""The queue core: ADR-0004's claim, fenced transitions, sweep and idempotency, and the typed
services the edges call (submission routing in `submit.py`, read models in `reads.py`,
schedules in `scheduling.py`, webhook endpoints in `webhook_endpoints.py`, tenants' limits in
`tenant_limits.py` and their holdings in `holdings.py`).

It knows nothing of HTTP, the runtime or the worker pool; they call it (tests/test_architecture.py
holds the rule). It runs no statement itself: its SQL is app/store's (app/store/sql/*.sql,
app/store/functions/*.sql), sent by `Database` and the store's typed calls. The sweeper that
runs `Queue.sweep` on an interval is app/maintenance/sweeper.py.
"""
