"""The queue core: ADR-0004's claim, fenced transitions, sweep and idempotency, and the typed
services the edges call (submission routing in `submit.py`, read models in `reads.py`, the
worker registry and maintenance leases in `housekeeping.py`).

It knows nothing of HTTP, the runtime or the worker pool; they call it (tests/test_architecture.py
holds the rule). Its SQL is in the .sql files beside this file (see sql.py); the sweeper that
runs `Queue.sweep` on an interval is app/maintenance/sweeper.py.
"""
