-- Live output deltas (docs/adr/0007-live-output-deltas.md): the one NOTIFY that is not a
-- transition's. Sent by each worker process's delta publisher (app/worker/deltas.py) on its own
-- autocommit connection, outside every fenced transaction, at most 10 a second per process,
-- each payload at most 4,000 bytes encoded (app/vocabulary/live_deltas.py packs it: the bound is on the
-- payload the caller passes, not on anything this statement aggregates), and not at all while
-- pg_notification_queue_usage() (reads.sql: notification_queue_usage) is above 1 %.
-- Channel turnstile_deltas, never turnstile: the claim loops and run watchers listening there
-- never see a delta, and only the API processes that hold streams listen here.


-- name: publish_deltas
SELECT pg_notify('turnstile_deltas', CAST(:payload AS text)) AS sent;
