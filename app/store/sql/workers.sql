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
-- has dismissed it: the dead letter is never pruned behind the operator's back. Runs of a
-- session are not this statement's: they are the session's transcript, kept while the
-- session is active and deleted with it (prune_idle_sessions).
DELETE FROM runs
WHERE id = ANY(ARRAY(
    SELECT id FROM runs
    WHERE finished_at < {{now}} - make_interval(secs => :retention_seconds)
      AND session_id IS NULL
      AND (status IN ('succeeded', 'cancelled')
           OR (status = 'failed' AND dismissed_at IS NOT NULL))
    ORDER BY finished_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
));


-- name: prune_idle_sessions
-- Session retention: sessions idle past :retention_seconds are deleted whole, a batch at a
-- time: their runs with everything the runs own (events, inputs, checkpoints, journal: ON
-- DELETE CASCADE), then the session. Idle means: no turn since the cutoff (last_activity_at,
-- set by every submission under the session lock; ix_sessions_last_activity_at finds the
-- candidates), no run active, none finished (or dismissed) since the cutoff, and no failed run
-- left undismissed (the dead letter is never pruned behind the operator's back).
-- The sessions are taken FOR UPDATE SKIP LOCKED, the lock every submission takes first: a turn
-- in flight makes this pass its session by, and a turn that commits first moves
-- last_activity_at, which the lock's recheck of the row then sees. A turn that arrives after
-- the delete finds no session (404), as for any session that was never there.
-- Idempotency keys of the session's turns are not touched: they expire on their own TTL.
WITH clock AS MATERIALIZED (
    SELECT {{now}} - make_interval(secs => :retention_seconds) AS cutoff
),
idle AS MATERIALIZED (
    SELECT s.id FROM sessions s, clock
    WHERE s.last_activity_at < clock.cutoff
      AND NOT EXISTS (
          SELECT 1 FROM runs r
          WHERE r.session_id = s.id
            AND (r.finished_at IS NULL
                 OR greatest(r.finished_at, r.dismissed_at) >= clock.cutoff
                 OR (r.status = 'failed' AND r.dismissed_at IS NULL)))
    ORDER BY s.last_activity_at
    LIMIT :limit
    FOR UPDATE OF s SKIP LOCKED
),
gone_runs AS (
    DELETE FROM runs WHERE session_id IN (SELECT id FROM idle)
    RETURNING id
),
gone AS (
    -- The runs referencing these sessions go in the same statement (gone_runs): the foreign
    -- key is checked at the statement's end, when they are gone.
    DELETE FROM sessions WHERE id IN (SELECT id FROM idle)
    RETURNING id
)
SELECT (SELECT count(*) FROM gone) AS sessions, (SELECT count(*) FROM gone_runs) AS runs;


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
