-- Schedules (app/queue/scheduling.py): the schedules table, and the runs that are their ticks.
--
-- A schedule's next tick exists ahead as a queued run (schedule_id, fire_at, scheduled_for =
-- fire_at); the claim starts it through the normal path. UNIQUE (schedule_id, fire_at) on runs
-- is the guarantee of one run per tick: whatever a process computes, the database refuses a
-- second run for the same tick. Every change to a schedule's ticks (create, advance, pause,
-- resume, delete) first takes the schedule row (`lock_schedules`, `lock_schedule`) in a
-- statement of its own: under READ COMMITTED the statements after it see every tick committed
-- by the holder it waited for, which one statement that locked and read at once would not.
-- {{now}} is the injectable clock, as everywhere (app/store/statements.py).


-- name: create_schedule
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
INSERT INTO schedules (id, tenant_id, principal, cron, timezone, agent, input, priority,
                       anchor_at, created_at, updated_at)
SELECT :id, :tenant_id, :principal, :cron, :timezone, :agent, CAST(:input AS jsonb),
       :priority, clock.now, clock.now, clock.now
FROM clock
RETURNING *;


-- name: lock_schedule
-- One schedule of a tenant (None: any), locked for a change to it and its ticks.
SELECT * FROM schedules
WHERE id = :id AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
FOR UPDATE;


-- name: lock_schedules
-- The active schedules among :ids, locked in id order (two advancing processes never
-- deadlock) to create their next ticks. A paused or deleted schedule is left out: its ticks
-- are not created.
SELECT * FROM schedules
WHERE id = ANY(CAST(:ids AS uuid[])) AND paused_at IS NULL
ORDER BY id
FOR UPDATE;


-- name: latest_ticks
-- Each schedule's latest tick (the unique index read backwards, one row each): what it covers
-- and whether it is still ahead (queued, never started).
SELECT s.id AS schedule_id, t.fire_at, t.started_at, t.status
FROM unnest(CAST(:ids AS uuid[])) AS s(id)
LEFT JOIN LATERAL (
    SELECT r.fire_at, r.started_at, r.status FROM runs r
    WHERE r.schedule_id = s.id
    ORDER BY r.fire_at DESC
    LIMIT 1
) AS t ON true;


-- name: create_ticks
-- The next ticks of locked schedules, as queued runs (turnstile_create_runs: exempt from the
-- queued quota, due at their fire time, so their tenant stays out of the fair walk until
-- then). One NOTIFY naming their priorities wakes the claim loops, which then sleep until the
-- earliest one is due (`next_due`). A tick that exists already is left alone: the unique
-- (schedule_id, fire_at) is the guarantee of one run per tick.
WITH tick AS (
    SELECT t.id, t.schedule_id, t.fire_at, s.tenant_id, s.principal, s.priority, s.agent,
           s.input, t.n
    FROM unnest(CAST(:ids AS uuid[]), CAST(:schedule_ids AS uuid[]),
                CAST(:fire_ats AS timestamptz[])) WITH ORDINALITY AS t(id, schedule_id, fire_at, n)
    JOIN schedules s ON s.id = t.schedule_id
),
run AS (
    SELECT r.id, r.priority FROM turnstile_create_runs(
        {{now}},
        ARRAY(SELECT id FROM tick ORDER BY n),
        ARRAY(SELECT tenant_id FROM tick ORDER BY n),
        ARRAY(SELECT principal FROM tick ORDER BY n),
        ARRAY(SELECT CAST(NULL AS uuid) FROM tick ORDER BY n),
        ARRAY(SELECT priority FROM tick ORDER BY n),
        ARRAY(SELECT agent FROM tick ORDER BY n),
        ARRAY(SELECT input FROM tick ORDER BY n),
        ARRAY(SELECT CAST(:max_attempts AS integer) FROM tick ORDER BY n),
        ARRAY(SELECT fire_at FROM tick ORDER BY n),
        ARRAY(SELECT schedule_id FROM tick ORDER BY n),
        ARRAY(SELECT fire_at FROM tick ORDER BY n),
        ARRAY(SELECT CAST(NULL AS uuid) FROM tick ORDER BY n),
        ARRAY(SELECT CAST(NULL AS text) FROM tick ORDER BY n),
        ARRAY(SELECT jsonb_build_object('schedule_id', schedule_id, 'fire_at', fire_at)
              FROM tick ORDER BY n),
        false, NULL) AS r
)
SELECT count(*) AS created,
       pg_notify('turnstile', jsonb_build_object(
           'work', (SELECT jsonb_agg(DISTINCT priority) FROM run))::text) AS notified
FROM run
-- No row (and no notification) when every tick existed already.
HAVING count(*) > 0;


-- name: pause_schedule
-- After lock_schedule. Removes the ticks created ahead and not started yet (a claim that took
-- one first keeps it: the DELETE waits for its row lock, then finds it running and skips it).
-- A tick never started has no history worth keeping; its events and input go with it.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
paused AS (
    UPDATE schedules s
    SET paused_at = coalesce(s.paused_at, clock.now), updated_at = clock.now
    FROM clock
    WHERE s.id = :id
    RETURNING s.*
),
dropped AS (
    -- Queued ticks hold no count (a tenant left with nothing to claim is settled by the
    -- next claim that walks it).
    DELETE FROM runs r USING paused
    WHERE r.schedule_id = paused.id AND r.status = 'queued' AND r.started_at IS NULL
    RETURNING r.id
)
SELECT paused.*, (SELECT count(*) FROM dropped) AS dropped
FROM paused;


-- name: resume_schedule
-- After lock_schedule. The anchor moves to now: the ticks skipped while paused never fire.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
UPDATE schedules s
SET paused_at = NULL, anchor_at = clock.now, updated_at = clock.now
FROM clock
WHERE s.id = :id AND s.paused_at IS NOT NULL
RETURNING s.*;


-- name: delete_schedule
-- After lock_schedule. The schedule and its ticks not started yet; runs that started (running,
-- waiting, finished, or queued again for a retry) are real work and stay, keeping its id.
WITH gone AS (
    DELETE FROM schedules WHERE id = :id RETURNING id
),
dropped AS (
    -- As in pause_schedule: queued ticks hold no count.
    DELETE FROM runs r USING gone
    WHERE r.schedule_id = gone.id AND r.status = 'queued' AND r.started_at IS NULL
    RETURNING r.id
)
SELECT gone.id, (SELECT count(*) FROM dropped) AS dropped
FROM gone;


-- name: schedules_missing_a_tick
-- Active schedules whose latest tick is not ahead (none yet, or it started, or it was
-- cancelled): the scheduler creates their next one. Keyset by id, a page at a time.
SELECT s.id FROM schedules s
WHERE s.paused_at IS NULL
  AND (CAST(:after AS uuid) IS NULL OR s.id > :after)
  AND NOT EXISTS (
      SELECT 1 FROM (
          SELECT r.status, r.started_at FROM runs r
          WHERE r.schedule_id = s.id
          ORDER BY r.fire_at DESC
          LIMIT 1
      ) AS latest
      WHERE latest.status = 'queued' AND latest.started_at IS NULL
  )
ORDER BY s.id
LIMIT :limit;


-- name: get_schedule
SELECT * FROM schedules
WHERE id = :id AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id);


-- name: list_schedules
-- Newest first, a keyset page after (:before_created, :before_id).
SELECT * FROM schedules
WHERE (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
  AND (CAST(:before_created AS timestamptz) IS NULL
       OR (created_at, id) < (CAST(:before_created AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY created_at DESC, id DESC
LIMIT :limit;


-- name: schedule_runs
-- A schedule's runs by fire time, newest first (the unique index read backwards), a keyset
-- page before (:before_fire, :before_id).
SELECT * FROM runs
WHERE schedule_id = :id
  AND (CAST(:before_fire AS timestamptz) IS NULL
       OR (fire_at, id) < (CAST(:before_fire AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY fire_at DESC, id DESC
LIMIT :limit;


-- name: schedule_stats
-- For the metrics: schedules by state; active ones without a tick ahead (normal only for the
-- moment between a tick's start and its successor's creation); and how late the most overdue
-- tick ahead is (due but not started: no free slot, no worker, or a backlog of its class).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
latest AS (
    SELECT s.paused_at, t.fire_at,
           (t.status = 'queued' AND t.started_at IS NULL) IS TRUE AS ahead
    FROM schedules s
    LEFT JOIN LATERAL (
        SELECT r.fire_at, r.started_at, r.status FROM runs r
        WHERE r.schedule_id = s.id
        ORDER BY r.fire_at DESC
        LIMIT 1
    ) AS t ON true
)
SELECT count(*) FILTER (WHERE paused_at IS NULL) AS active,
       count(*) FILTER (WHERE paused_at IS NOT NULL) AS paused,
       count(*) FILTER (WHERE paused_at IS NULL AND NOT ahead) AS without_tick,
       coalesce(max(extract(epoch FROM clock.now - fire_at))
                    FILTER (WHERE paused_at IS NULL AND ahead AND fire_at < clock.now),
                0) AS most_overdue_seconds
FROM latest, clock
GROUP BY clock.now;
