-- Workers: each pool registers itself, refreshes last_seen with its heartbeats, and marks
-- itself stopped on a clean exit. Not part of any run's state; kept here with the rest.

-- name: register_worker
INSERT INTO workers (id, host, pid, role, slot_groups, started_at, last_seen_at)
VALUES (:id, :host, :pid, :role, CAST(:slot_groups AS jsonb), {{now}}, {{now}})
ON CONFLICT (id) DO UPDATE
SET last_seen_at = excluded.last_seen_at, stopped_at = NULL, slot_groups = excluded.slot_groups
RETURNING id;


-- name: touch_worker
UPDATE workers SET last_seen_at = {{now}}, slot_groups = CAST(:slot_groups AS jsonb)
WHERE id = :id
RETURNING id;


-- name: deregister_worker
UPDATE workers SET stopped_at = {{now}}, last_seen_at = {{now}}
WHERE id = :id
RETURNING id;


-- Maintenance: one instance of each service at a time across all processes, through a lease
-- row. A holder renews it each tick; a crashed holder's lease expires and another takes over.

-- name: maintenance_acquire
INSERT INTO maintenance_leases (name, holder, expires_at)
VALUES (:name, :holder, {{now}} + make_interval(secs => :ttl_seconds))
ON CONFLICT (name) DO UPDATE
SET holder = excluded.holder, expires_at = excluded.expires_at
WHERE maintenance_leases.holder = excluded.holder
   OR maintenance_leases.expires_at <= {{now}}
RETURNING holder;


-- name: maintenance_succeeded
UPDATE maintenance_leases SET last_success_at = {{now}}
WHERE name = :name AND holder = :holder;


-- name: maintenance_release
UPDATE maintenance_leases SET expires_at = {{now}}
WHERE name = :name AND holder = :holder;


-- name: prune_idempotency_keys
-- Expired keys, a batch at a time, so no statement holds many row locks for long.
DELETE FROM idempotency_keys
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys
    WHERE expires_at < {{now}}
    LIMIT :limit
));


-- name: prune_finished_runs
-- Retention: finished runs past the retention period, with their events, inputs, checkpoints
-- and journal (ON DELETE CASCADE), a batch at a time. A failed run stays until an operator
-- has dismissed it: the dead letter is never pruned behind the operator's back.
DELETE FROM runs
WHERE id = ANY(ARRAY(
    SELECT id FROM runs
    WHERE finished_at < {{now}} - make_interval(secs => :retention_seconds)
      AND (status IN ('succeeded', 'cancelled')
           OR (status = 'failed' AND dismissed_at IS NOT NULL))
    ORDER BY finished_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
));


-- name: live_slots_per_class
-- The slots of the live worker processes (registered, not stopped, seen within
-- :stale_seconds) that can claim each class: a group's slots count for every class it lists.
-- A class missing from the answer has no live slot anywhere (docs/adr/0005): its queued runs
-- wait until a process that serves it starts.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT c.value AS class, sum(CAST(g.value ->> 'size' AS integer)) AS slots
FROM workers w
CROSS JOIN clock
CROSS JOIN LATERAL jsonb_array_elements(w.slot_groups) AS g(value)
CROSS JOIN LATERAL jsonb_array_elements_text(g.value -> 'classes') AS c(value)
WHERE w.stopped_at IS NULL
  AND w.last_seen_at >= clock.now - make_interval(secs => :stale_seconds)
GROUP BY 1;
