-- Webhook endpoints (app/queue/webhooks.py). The deliveries themselves are inserted by the
-- transitions they report (runs.sql's webhook_deliveries fragment).


-- name: webhook_create
INSERT INTO webhook_endpoints (tenant_id, principal, url, events, secret_ciphertext)
VALUES (:tenant_id, :principal, :url, CAST(:events AS text[]), :secret)
RETURNING id, tenant_id, url, events, consecutive_failures, disabled_at, created_at;


-- name: webhook_list
SELECT id, tenant_id, url, events, consecutive_failures, disabled_at, created_at
FROM webhook_endpoints
WHERE tenant_id = :tenant_id AND deleted_at IS NULL
ORDER BY created_at, id;


-- name: webhook_rotate
UPDATE webhook_endpoints
SET secret_ciphertext = :secret, updated_at = {{now}}
WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL
RETURNING id;


-- name: webhook_enable
-- An operator re-enables an endpoint that failed deliveries disabled (once its receiver is
-- fixed): its count starts again from zero. The transitions' partial index takes it back.
UPDATE webhook_endpoints
SET disabled_at = NULL, consecutive_failures = 0, updated_at = {{now}}
WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL
RETURNING id, tenant_id, url, events, consecutive_failures, disabled_at, created_at;


-- name: webhook_delete
-- The endpoint is marked deleted (its past deliveries keep their link) and its pending
-- deliveries are cancelled in the same statement, each as `cancel` would: epoch bumped (a worker
-- sending one is fenced at its next write), run.cancelled written. No delivery reports them.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
endpoint AS (
    UPDATE webhook_endpoints
    SET deleted_at = clock.now, updated_at = clock.now
    FROM clock
    WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL
    RETURNING id
),
pending AS MATERIALIZED (
    -- Rows in id order, as the other multi-row statements lock them (runs.sql's header).
    -- `was`: the status as locked (the counts move from it).
    SELECT r.id, r.status AS was FROM webhook_deliveries d
    JOIN endpoint ON endpoint.id = d.endpoint_id
    JOIN runs r ON r.id = d.run_id
    WHERE r.status IN ('queued', 'running', 'waiting_for_user')
    ORDER BY r.id
    FOR UPDATE OF r
),
cancelled AS (
    UPDATE runs r
    SET status = 'cancelled',
        lease_epoch = r.lease_epoch + 1,
        lease_owner = NULL,
        lease_expires_at = NULL,
        finished_at = clock.now,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM pending, clock
    WHERE r.id = pending.id AND r.status IN ('queued', 'running', 'waiting_for_user')
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.tenant_id, r.priority
),
-- The cancelled deliveries leave their tenant's counts (runs.sql's count_moves).
moves AS (
    SELECT cancelled.tenant_id, cancelled.priority / 10 AS band,
           CASE WHEN pending.was = 'running' THEN -1 ELSE 0 END AS d_running,
           CASE WHEN pending.was = 'queued' THEN -1 ELSE 0 END AS d_queued
    FROM cancelled JOIN pending ON pending.id = cancelled.id
),
{{count_moves}},
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT cancelled.id, cancelled.last_event_seq, 'run.cancelled', cancelled.lease_epoch,
           jsonb_build_object('by', CAST(:actor AS text), 'reason', 'webhook endpoint deleted'),
           clock.now
    FROM cancelled, clock
)
SELECT (SELECT count(*) FROM endpoint) AS deleted, (SELECT count(*) FROM cancelled) AS cancelled
FROM (SELECT count(*) FROM move_clear) AS cleared;


-- name: webhook_for_delivery
-- What a delivery run sends to: its endpoint as it is now (a rotated secret, a new state), and
-- only when it belongs to the run's own tenant.
SELECT e.id, e.url, e.secret_ciphertext, e.disabled_at, e.deleted_at
FROM runs r
JOIN webhook_endpoints e ON e.id = :endpoint_id AND e.tenant_id = r.tenant_id
WHERE r.id = :run_id;


-- name: webhook_delivery_succeeded
UPDATE webhook_endpoints
SET consecutive_failures = 0
WHERE id = :id AND consecutive_failures <> 0;


-- name: webhook_delivery_failed
-- Counts a failed delivery (its last attempt failed, or the receiver refused it for good); at
-- :disable_after in a row the endpoint is disabled (its transitions stop producing deliveries:
-- the partial index leaves it out).
UPDATE webhook_endpoints e
SET consecutive_failures = e.consecutive_failures + 1,
    disabled_at = CASE WHEN e.disabled_at IS NULL
                            AND e.consecutive_failures + 1 >= :disable_after
                       THEN {{now}} ELSE e.disabled_at END,
    updated_at = {{now}}
WHERE e.id = :id
RETURNING e.tenant_id, e.consecutive_failures,
          -- true on the delivery that disabled it, so it is reported once
          (e.disabled_at IS NOT NULL AND e.consecutive_failures = :disable_after) AS disabled_now;
