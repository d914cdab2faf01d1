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
  AND run_id IS NULL  -- an A2A task's push configurations are listed through A2A
ORDER BY created_at, id;


-- name: webhook_rotate
UPDATE webhook_endpoints
SET secret_ciphertext = :secret, updated_at = {{now}}
-- An A2A push configuration's ciphertext is its token, not a signing secret: not rotated here.
WHERE id = :id AND tenant_id = :tenant_id AND deleted_at IS NULL AND run_id IS NULL
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
SELECT e.id, e.url, e.secret_ciphertext, e.disabled_at, e.deleted_at, e.format
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


-- name: task_push_count
-- How many live push configurations an A2A task has (its cap), after the tenant's holdings
-- lock, so concurrent creations count one after the other.
SELECT count(*) FROM webhook_endpoints
WHERE run_id = :run_id AND tenant_id = :tenant_id AND deleted_at IS NULL;


-- name: task_push_create
-- An A2A task's push configuration: an endpoint of the run's tenant reporting that run only
-- (runs.sql's fan-out matches it by run_id). Its events are a name no transition has, so a
-- release before migration 0021 (whose fan-out knows no run_id) never delivers to it.
INSERT INTO webhook_endpoints (tenant_id, principal, url, events, secret_ciphertext, run_id,
                               format)
VALUES (:tenant_id, :principal, :url, ARRAY['a2a.task'], :secret, :run_id, 'a2a')
RETURNING id, run_id, url, secret_ciphertext, consecutive_failures, disabled_at, created_at;


-- name: task_push_list
-- A task's live push configurations, oldest first, a page after :after (an id; NULL: first).
SELECT id, run_id, url, secret_ciphertext, consecutive_failures, disabled_at, created_at
FROM webhook_endpoints
WHERE run_id = :run_id AND tenant_id = :tenant_id AND deleted_at IS NULL
  AND (CAST(:after AS uuid) IS NULL OR id > :after)
ORDER BY id
LIMIT :limit;


-- name: task_push_get
SELECT id, run_id, url, secret_ciphertext, consecutive_failures, disabled_at, created_at
FROM webhook_endpoints
WHERE id = :id AND run_id = :run_id AND tenant_id = :tenant_id AND deleted_at IS NULL;


-- name: task_push_lock_run
-- Taken before a new push configuration's catch-up (task_push_catch_up, the next statement of
-- the same transaction): a transition of the run in flight commits first, and none starts
-- until this transaction ends, so the catch-up sees the run as it stands.
SELECT id FROM runs WHERE id = :run_id FOR NO KEY UPDATE;


-- name: task_push_catch_up
-- A push configuration stored after its task had already asked or ended (a SendMessage that
-- started the task: the transition's statement could not see the configuration yet) gets the
-- delivery that transition would have made, once: only while the configuration has none. A
-- transition that saw the configuration made its own, and this sees it (its own snapshot,
-- after task_push_lock_run). The body is the one runs.sql's webhook_deliveries fragment
-- builds, from the run's row.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
hook AS MATERIALIZED (
    SELECT gen_random_uuid() AS id, e.id AS endpoint_id, e.principal, r.tenant_id,
           r.id AS source_id,
           CASE r.status WHEN 'succeeded' THEN 'run.succeeded' WHEN 'failed' THEN 'run.failed'
                         WHEN 'cancelled' THEN 'run.cancelled' ELSE 'run.waiting' END AS event,
           jsonb_build_object('run_id', r.id, 'session_id', r.session_id, 'status', r.status)
           || CASE r.status WHEN 'succeeded' THEN jsonb_build_object('result', r.result)
                            WHEN 'failed' THEN jsonb_build_object('failure', r.failure)
                            WHEN 'waiting_for_user' THEN jsonb_build_object('question', r.question)
                            ELSE '{}'::jsonb END AS data,
           clock.now
    FROM webhook_endpoints e
    JOIN runs r ON r.id = e.run_id AND r.tenant_id = e.tenant_id
    CROSS JOIN clock
    WHERE e.id = :id AND e.deleted_at IS NULL AND e.disabled_at IS NULL
      AND r.status IN ('succeeded', 'failed', 'cancelled', 'waiting_for_user')
      AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.endpoint_id = e.id)
),
hook_run AS (
    SELECT created.id
    FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM hook)) AS any_hook
    CROSS JOIN LATERAL turnstile_create_runs(
        (SELECT now FROM clock),
        ARRAY(SELECT id FROM hook), ARRAY(SELECT tenant_id FROM hook),
        ARRAY(SELECT principal FROM hook), ARRAY(SELECT CAST(NULL AS uuid) FROM hook),
        ARRAY(SELECT CAST(10 AS smallint) FROM hook), ARRAY(SELECT CAST('webhook' AS text) FROM hook),
        ARRAY(SELECT jsonb_build_object(
                         'webhook_id', id, 'endpoint_id', endpoint_id,
                         'body', jsonb_build_object('type', event, 'timestamp', now,
                                                    'data', data))
              FROM hook),
        ARRAY(SELECT CAST(:hook_attempts AS integer) FROM hook),
        ARRAY(SELECT CAST(NULL AS timestamptz) FROM hook),
        ARRAY(SELECT CAST(NULL AS uuid) FROM hook),
        ARRAY(SELECT CAST(NULL AS timestamptz) FROM hook),
        ARRAY(SELECT CAST(NULL AS uuid) FROM hook),
        ARRAY(SELECT CAST(NULL AS text) FROM hook),
        ARRAY(SELECT jsonb_build_object('webhook', jsonb_build_object(
                         'endpoint_id', endpoint_id, 'source_run_id', source_id,
                         'event', event))
              FROM hook),
        false, NULL) AS created
),
hook_link AS (
    INSERT INTO webhook_deliveries (run_id, endpoint_id, source_run_id, event, created_at)
    SELECT id, endpoint_id, source_id, event, now FROM hook
)
-- The delivery's claimers look now (as the transitions' NOTIFY says "work": [10]).
SELECT count(*) AS made,
       CASE WHEN count(*) > 0
            THEN pg_notify('turnstile', jsonb_build_object('work', jsonb_build_array(10))::text)
       END AS notified
FROM hook_run;
