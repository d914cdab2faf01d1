-- The operator dashboard's read models (app/ui reads them through app/queue/reads.py, whose
-- rows app/store/read_rows.py sends; never directly). None of them writes: the dashboard's actions go through the queue core
-- (app/queue/submit.py), like the HTTP API's; its sign-in sessions belong to app/security.
--
-- Tenant scoping: every statement takes :tenant_id; NULL means the whole queue (admin keys).
-- The runs list also takes :principal: a key without a scope lists its own principal's runs.


-- name: ui_runs
-- The runs list: optional filters on status, class (a priority band), session and creation
-- time; newest first, keyset-paginated on (created_at, id). The tenant's rows come from
-- ix_runs_tenant_id_status_created_at, a session's from ix_runs_session_id_created_at.
SELECT * FROM runs
WHERE (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR principal = :principal)
  AND (CAST(:status AS text) IS NULL OR status = :status)
  AND (CAST(:min_priority AS smallint) IS NULL
       OR priority BETWEEN CAST(:min_priority AS smallint) AND CAST(:max_priority AS smallint))
  AND (CAST(:session_id AS uuid) IS NULL OR session_id = :session_id)
  AND (CAST(:since AS timestamptz) IS NULL OR created_at >= :since)
  AND (CAST(:until AS timestamptz) IS NULL OR created_at < :until)
  AND (CAST(:before_created AS timestamptz) IS NULL
       OR (created_at, id) < (CAST(:before_created AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY created_at DESC, id DESC
LIMIT :limit;


-- name: ui_throughput
-- Runs started (first claimed) and finished per class over the last :minutes, with the last
-- minute and the last five broken out. A run started in the window is still active or finished
-- in it, so the scan reads only those rows' timestamps.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT r.priority / 10 AS class_index,
       count(*) FILTER (WHERE r.started_at >= clock.now - interval '1 minute') AS started_1m,
       count(*) FILTER (WHERE r.started_at >= clock.now - interval '5 minutes') AS started_5m,
       count(*) FILTER (WHERE r.started_at >= clock.now - make_interval(mins => :minutes))
           AS started_window,
       count(*) FILTER (WHERE r.finished_at >= clock.now - interval '1 minute') AS finished_1m,
       count(*) FILTER (WHERE r.finished_at >= clock.now - interval '5 minutes') AS finished_5m,
       count(*) FILTER (WHERE r.finished_at >= clock.now - make_interval(mins => :minutes))
           AS finished_window,
       count(*) FILTER (WHERE r.status = 'failed'
                        AND r.finished_at >= clock.now - make_interval(mins => :minutes))
           AS failed_window
FROM runs r, clock
WHERE (r.started_at >= clock.now - make_interval(mins => :minutes)
       OR r.finished_at >= clock.now - make_interval(mins => :minutes))
  AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
GROUP BY 1
ORDER BY 1;


-- name: ui_recoveries
-- Fences, lease-expiry requeues and early or graceful releases over the last :minutes, from the
-- runs' event logs.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT e.type, count(*) AS events
FROM run_events e
JOIN runs r ON r.id = e.run_id
CROSS JOIN clock
WHERE e.type IN ('run.fenced', 'run.requeued', 'run.released')
  AND e.created_at >= clock.now - make_interval(mins => :minutes)
  AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
GROUP BY e.type;


-- name: ui_dead_letter_count
SELECT count(*) AS runs FROM runs
WHERE status = 'failed' AND dismissed_at IS NULL
  AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id);


-- name: ui_slot_groups
-- Slot occupancy per slot group, summed over the live worker processes (registered, not
-- stopped, seen within :stale_seconds). Each process rewrites its row's busy counts with every
-- heartbeat, so they are at most one heartbeat interval old. Slots are shared by every tenant.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT g.value ->> 'name' AS name,
       g.value -> 'classes' AS classes,
       sum(CAST(g.value ->> 'size' AS integer)) AS size,
       sum(CAST(coalesce(g.value ->> 'busy', '0') AS integer)) AS busy,
       count(*) AS processes
FROM workers w
CROSS JOIN clock
CROSS JOIN LATERAL jsonb_array_elements(w.slot_groups) AS g(value)
WHERE w.stopped_at IS NULL
  AND w.last_seen_at >= clock.now - make_interval(secs => :stale_seconds)
GROUP BY 1, 2
ORDER BY 1;


-- name: ui_worker_hosts
-- Where the workers named in a run's lease and events run. Worker ids are opaque (tenants see
-- them); only operator and admin keys are shown the host and pid behind them.
SELECT id, host, pid FROM workers WHERE id = ANY(CAST(:ids AS text[]));


-- name: ui_webhook_deliveries
-- The latest :per_endpoint deliveries of each of these endpoints (each delivery is a run of the
-- `webhook` agent), newest first, with how each one went; ix_webhook_deliveries_endpoint_id
-- finds them. The endpoints' own tenant check is the caller's (webhook_list).
SELECT d.endpoint_id, d.run_id, d.source_run_id, d.event, d.created_at,
       r.status, r.attempts, r.max_attempts, r.failure, r.finished_at
FROM unnest(CAST(:ids AS uuid[])) AS e(id)
CROSS JOIN LATERAL (
    SELECT * FROM webhook_deliveries
    WHERE endpoint_id = e.id
    ORDER BY created_at DESC, run_id DESC
    LIMIT :per_endpoint
) AS d
JOIN runs r ON r.id = d.run_id
ORDER BY d.endpoint_id, d.created_at DESC, d.run_id DESC;


-- name: ui_webhook_delivery_counts
-- Each endpoint's deliveries over the last :hours by outcome: delivered, failed (after all
-- their attempts), still pending (queued, running or waiting for a retry).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT d.endpoint_id,
       count(*) FILTER (WHERE r.status = 'succeeded') AS delivered,
       count(*) FILTER (WHERE r.status IN ('failed', 'cancelled')) AS failed,
       count(*) FILTER (WHERE r.status IN ('queued', 'running', 'waiting_for_user')) AS pending
FROM webhook_deliveries d
JOIN runs r ON r.id = d.run_id
CROSS JOIN clock
WHERE d.endpoint_id = ANY(CAST(:ids AS uuid[]))
  AND d.created_at >= clock.now - make_interval(hours => :hours)
GROUP BY d.endpoint_id;


-- name: ui_charts
-- The overview's charts: :minutes one-minute buckets ending with the current one, each with
-- the runs finished in it, the runs first claimed in it and their claim latency (the wait from
-- being eligible, creation or `scheduled_for`, to the first claim: median and maximum), and
-- the queue's depth at the bucket's end, counted as runs eligible then and not yet claimed
-- for the first time (a requeued run is not counted again: runs keep no history of it but
-- their events). Only runs that finished, were claimed, or still wait within the window are
-- read: the rest of the table's history cannot change these numbers.
WITH clock AS MATERIALIZED (
    SELECT {{now}} AS now,
           date_trunc('minute', {{now}}) - make_interval(mins => :minutes - 1) AS start
),
buckets AS (
    SELECT i, clock.start + make_interval(mins => i) AS from_at,
           least(clock.start + make_interval(mins => i + 1), clock.now) AS to_at
    FROM clock, generate_series(0, :minutes - 1) AS i
),
recent AS MATERIALIZED (
    SELECT greatest(r.created_at, coalesce(r.scheduled_for, r.created_at)) AS eligible_at,
           r.started_at, r.finished_at
    FROM runs r, clock
    WHERE (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
      AND r.created_at <= clock.now
      AND (r.started_at IS NULL OR r.started_at >= clock.start
           OR r.finished_at >= clock.start)
      AND (r.started_at IS NOT NULL OR r.finished_at IS NULL OR r.finished_at >= clock.start)
)
SELECT b.i,
       b.from_at,
       count(*) FILTER (WHERE r.finished_at >= b.from_at AND r.finished_at < b.to_at)
           AS finished,
       count(*) FILTER (WHERE r.started_at >= b.from_at AND r.started_at < b.to_at)
           AS claimed,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.started_at - r.eligible_at))
           FILTER (WHERE r.started_at >= b.from_at AND r.started_at < b.to_at)
           AS latency_median,
       max(extract(epoch FROM r.started_at - r.eligible_at))
           FILTER (WHERE r.started_at >= b.from_at AND r.started_at < b.to_at)
           AS latency_max,
       count(*) FILTER (WHERE r.eligible_at <= b.to_at
                        AND coalesce(r.started_at, r.finished_at, 'infinity') > b.to_at)
           AS depth
FROM buckets b
LEFT JOIN recent r ON true
GROUP BY b.i, b.from_at
ORDER BY b.i;


-- name: ui_session_pending_turns
-- A session's page: the turns waiting for its active run, in the order they will start (an
-- interrupting turn first, then by acceptance, as turnstile_promote_turns takes them), from
-- the partial index ix_pending_turns_session_id_seq. Turns that left pending are not listed:
-- the run each became is in the session's runs.
SELECT p.*, row_number() OVER (ORDER BY (p.policy = 'interrupt') DESC, p.seq) AS position
FROM pending_turns p
WHERE p.session_id = :session_id AND p.status = 'pending'
  AND (CAST(:tenant_id AS text) IS NULL OR p.tenant_id = :tenant_id)
ORDER BY (p.policy = 'interrupt') DESC, p.seq
LIMIT :limit;


-- name: ui_cancel_reasons
-- Why each of these cancelled runs ended, from its run.cancelled event (the run row keeps no
-- reason): interrupted, expired, or the words of whoever cancelled it, and who that was. Each
-- run's events are read through the primary key (run_id, seq); a run is cancelled once.
SELECT DISTINCT ON (e.run_id) e.run_id, e.data ->> 'reason' AS reason, e.data ->> 'by' AS by
FROM run_events e
WHERE e.run_id = ANY(CAST(:ids AS uuid[])) AND e.type = 'run.cancelled'
ORDER BY e.run_id, e.seq DESC;
