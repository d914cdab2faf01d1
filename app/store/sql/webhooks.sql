-- Webhook endpoints (app/queue/webhook_endpoints.py). The deliveries themselves are inserted by the
-- transitions they report (runs.sql's webhook_deliveries fragment).


-- name: webhook_create
INSERT INTO webhook_endpoints (tenant_id, principal, url, events, secret_ciphertext)
VALUES (:tenant_id, :principal, :url, CAST(:events AS text[]), :secret)
RETURNING id, tenant_id, url, events, consecutive_failures, disabled_at, created_at;


-- name: webhook_list
SELECT id, tenant_id, url, events, consecutive_failures, disabled_at, created_at
FROM webhook_endpoints
WHERE (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id) AND deleted_at IS NULL
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


-- name: webhook_disable
-- An operator stops deliveries to an endpoint by hand (the dashboard's button), as failed
-- deliveries do: no transition makes a delivery to it while disabled, and a pending one that
-- runs fails at once; webhook_enable takes it back. Disabling a disabled one changes nothing.
UPDATE webhook_endpoints
SET disabled_at = coalesce(disabled_at, {{now}}), updated_at = {{now}}
WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL
RETURNING id, tenant_id, url, events, consecutive_failures, disabled_at, created_at;


-- name: webhook_delete
-- The endpoint is marked deleted (its past deliveries keep their link): no transition makes a
-- delivery to it from now on, and a pending one that runs fails at once. Its pending
-- deliveries are then cancelled a batch at a time (webhook_pending_deliveries, cancel_runs),
-- each batch its own transaction, so a dead receiver's backlog of any size is deleted within
-- the statement timeout.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
UPDATE webhook_endpoints
SET deleted_at = clock.now, updated_at = clock.now
FROM clock
WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL
RETURNING id;


-- name: webhook_pending_deliveries
-- Up to :limit of a deleted endpoint's deliveries not finished yet, in id order.
SELECT r.id FROM webhook_deliveries d
JOIN runs r ON r.id = d.run_id
WHERE d.endpoint_id = :id AND r.status IN ('queued', 'running', 'waiting_for_user')
ORDER BY r.id
LIMIT :limit;


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
