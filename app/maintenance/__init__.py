"""Maintenance services: the sweeper, pruning of expired idempotency keys, and retention of
finished runs. Each is small, has a `run_once()` that tests call, and runs as one instance at a
time across all processes through a lease row (`maintenance_leases`)."""
