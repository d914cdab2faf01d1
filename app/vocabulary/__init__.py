"""The leaf every layer shares: run statuses, priority classes, the slot layout, the records the
store hands out (runs, leases, the outcomes of fenced writes), and what a tenant's or a
principal's name may be (`names.py`). It imports no other package of Turnstile, so nothing
that imports it can form a cycle through it."""
