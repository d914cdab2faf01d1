"""The leaf every layer shares: run statuses, priority classes, the slot layout, and the records
the store hands out (runs, leases, the outcomes of fenced writes). It imports no other package
of Turnstile, so nothing that imports it can form a cycle through it."""
