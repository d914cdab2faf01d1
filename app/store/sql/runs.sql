-- The transitions of runs: every statement that creates a run, claims one, writes under a
-- lease, ends a hold, requeues or cancels (docs/architecture.md, "One turn, end to end").
--
-- Conventions, checked by tests/store/test_statement_checks.py:
-- * `-- name: x` starts statement x; `-- fenced` marks a worker write made under a lease. A
--   fenced statement begins by taking the run row with
--       WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
--   in an UPDATE ... RETURNING (or takes its rows FOR UPDATE under that fence, in id order),
--   and everything else it writes (events, checkpoints, journal rows) selects FROM that CTE,
--   so nothing commits once the run was reclaimed, cancelled or finished: a zero-row result
--   means "fenced: stop, never retry".
-- * {{now}} is the clock: the database's now(), or the :now a test injects. No statement reads
--   a worker's clock.
-- * Events get the next per-run sequence number by bumping runs.last_event_seq in the same
--   statement that takes the row, so sequences have no gaps and follow the row lock's order.
--   An event records the lease epoch of the run when it was written (a worker's own epoch for
--   fenced writes), so epochs never decrease in sequence order; run.fenced is the exception, it
--   records the stale epoch of the worker that lost the run.
-- * NOTIFY serializes commits, so a statement notifies at most once (one pg_notify in its final
--   SELECT, aggregated over rows), and only on enqueue, requeue, delivery, waiting and terminal
--   transitions; never on claims or heartbeats. Payload on channel turnstile:
--   {"work": [priorities], "runs": [run id prefixes], "sessions": [a session id prefix],
--   "more": true}; "sessions" names the one session a single enqueue added a run to.
-- * A payload is bounded whatever the number of rows, because PostgreSQL refuses one of 8,000
--   bytes or more and rolls the whole statement back with it: a notification must never fail
--   a transition. "work" holds distinct priorities (at most 30, the CHECK range); "runs" names
--   at most 500 runs, each by the first 8 characters of its id (listeners match prefixes; a
--   rare false match only costs a re-read); "more": true means "more runs changed than named:
--   re-read everything you watch". 500 covers the largest completion batch (256) and a sweep
--   batch (500). Largest payload: about 6.2 kB (12 bytes a name), under the 8,000-byte limit.
-- * Every multi-row statement takes its run rows in id order (a `locked` CTE, `ORDER BY id FOR
--   UPDATE`) before it updates them: `UPDATE ... FROM unnest(...)` locks rows in the join's
--   order, and two batches of one process in opposite orders deadlocked each other.
-- * Runs are created by turnstile_create_runs alone (app/store/functions/), whatever makes
--   them. Every statement that moves a run into or out of running, or back into queued, keeps
--   its tenant's count row in the same statement through the `count_moves` fragment: running
--   counts exact at every commit, and the fair walk's marks (docs/adr/0009). Count rows are
--   locked after the runs, in (tenant_id, band) order.


-- fragment: count_moves
-- The statement defines `moves` (tenant_id, band, d_running, requeued_at: one row per run it
-- moved into or out of running, and requeued_at the time a run it put back into queued becomes
-- eligible, NULL for none). The sums go to each pair's count row, locked after the runs in
-- (tenant_id, band) order. The new values are computed from the rows as `count_lock` locked
-- them (their latest versions), never from this statement's snapshot: a claim that committed
-- while this waited on a run row is counted (a snapshot's count, decremented, failed CHECK
-- (running >= 0) before the update could see the newer row). A requeued run eligible now sets
-- has_work; a later one brings due_at forward; the row is held, so a settle running meanwhile
-- cannot take the mark back (turnstile_settle_work). A pair without a row yet (a first run of
-- a class, created by a transition's webhook delivery) only ever gains: it is inserted.
count_total AS MATERIALIZED (
    SELECT tenant_id, CAST(band AS smallint) AS band, CAST(sum(d_running) AS integer) AS d_running,
           min(requeued_at) AS first_at
    FROM moves
    GROUP BY 1, 2
    HAVING sum(d_running) <> 0 OR min(requeued_at) IS NOT NULL
),
count_lock AS MATERIALIZED (
    -- By key: `tenant_id = ANY(ARRAY(...))` is an index condition on the primary key, so the
    -- rows are found by lookups whatever the number of tenants (tests/store/test_count_row_lookups.py).
    SELECT c.tenant_id, c.band, c.running, c.has_work, c.due_at FROM tenant_class_counts c
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM count_total))
      AND (c.tenant_id, c.band) IN (SELECT tenant_id, band FROM count_total)
    ORDER BY c.tenant_id, c.band
    FOR UPDATE
),
counted AS (
    UPDATE tenant_class_counts c
    SET running = l.running + m.d_running,
        has_work = l.has_work OR coalesce(m.first_at <= clock.now, false),
        due_at = CASE WHEN l.has_work OR coalesce(m.first_at <= clock.now, false) THEN NULL
                      ELSE least(l.due_at, m.first_at) END
    FROM count_lock l JOIN count_total m ON m.tenant_id = l.tenant_id AND m.band = l.band,
         clock
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM count_lock))  -- by key, as above
      AND c.tenant_id = l.tenant_id AND c.band = l.band
    RETURNING c.tenant_id
),
count_insert AS (
    INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued, has_work, due_at)
    SELECT m.tenant_id, m.band, m.d_running, 0, coalesce(m.first_at <= clock.now, false),
           CASE WHEN m.first_at > clock.now THEN m.first_at END
    FROM count_total m CROSS JOIN clock
    WHERE NOT EXISTS (SELECT 1 FROM count_lock l
                      WHERE l.tenant_id = m.tenant_id AND l.band = m.band)
    ORDER BY m.tenant_id, m.band
    ON CONFLICT (tenant_id, band) DO UPDATE
    SET running = c.running + excluded.running,
        has_work = c.has_work OR excluded.has_work,
        due_at = CASE WHEN c.has_work OR excluded.has_work THEN NULL
                      ELSE least(c.due_at, excluded.due_at) END
    RETURNING c.tenant_id
)


-- fragment: start_before
-- A new run's (or a pending turn's) deadline to start: the start_before given, else the
-- start_within counted from when it becomes eligible, as turnstile_submit counts it (its
-- scheduled_for, or now when that is later; greatest ignores a NULL); neither, no deadline.
coalesce(CAST(:start_before AS timestamptz),
         greatest(CAST(:scheduled_for AS timestamptz), {{now}})
         + make_interval(secs => CAST(:start_within AS double precision)))


-- fragment: settled_outcome
-- The outcome an open call `j` (journal 'started', nothing after) is given when its run ends
-- for good with it open: an unsafe call may have taken effect, so it is 'uncertain'; a safe
-- or keyed one would be harmless to repeat, so it is only 'abandoned'.
CASE WHEN j.idempotency_class = 'unsafe' THEN 'uncertain' ELSE 'abandoned' END AS settled


-- fragment: settled_message
-- The outcome's message for an open call `c` settled at its run's end; :unknown is the
-- runtime's own words for an unknown outcome (app/queue/core.py's UNKNOWN_OUTCOME).
jsonb_build_object('message', CASE c.settled
    WHEN 'uncertain' THEN CAST(:unknown AS text)
    ELSE 'the run ended before this call finished; it was not repeated' END)


-- fragment: webhook_deliveries
-- Webhooks: a statement that makes a transition webhooks report defines `hook_source`
-- (run_id, tenant_id, agent, event, data: one row per transition it made), and this turns each
-- row into one delivery per live endpoint of the run's tenant that takes the event: a queued
-- async-class run of the built-in `webhook` agent (through turnstile_create_runs, exempt from
-- the queued quota, its own attempts :hook_attempts) with its link to the endpoint. In the
-- transition's own statement, so a committed transition always has its deliveries and a
-- fenced one (no row) never has any. A tenant without endpoints pays one empty probe of the
-- partial index ix_webhook_endpoints_tenant_id and one of ix_webhook_endpoints_run_id (its
-- task's A2A push configurations), and no function call. The statement's final
-- SELECT must read `hook_run` (a SELECT in WITH runs only when read), and its NOTIFY adds
-- "work": [10] when `hook` has rows. It comes after the statement's `count_moves`, and
-- `hook_run` reads their results: the deliveries' marks on their count rows (statements of
-- turnstile_create_runs) then follow this statement's own changes to those rows, which they
-- see; the other way round, the count moves could neither lock nor change a row a
-- delivery's mark had already changed.
hook AS MATERIALIZED (
    SELECT gen_random_uuid() AS id, e.id AS endpoint_id, e.principal, s.tenant_id,
           s.run_id AS source_id, s.event, s.data, clock.now
    FROM hook_source s
    CROSS JOIN LATERAL (
        SELECT w.id, w.principal FROM webhook_endpoints w
        WHERE w.tenant_id = s.tenant_id AND w.run_id IS NULL
          AND w.deleted_at IS NULL AND w.disabled_at IS NULL
          AND (cardinality(w.events) = 0 OR s.event = ANY(w.events))
        UNION ALL
        -- An A2A task's push configurations (migration 0021): every event of their own run,
        -- through ix_webhook_endpoints_run_id, so a tenant's many tasks' configurations are
        -- never in its webhooks' probe.
        SELECT w.id, w.principal FROM webhook_endpoints w
        WHERE w.run_id = s.run_id AND w.tenant_id = s.tenant_id
          AND w.deleted_at IS NULL AND w.disabled_at IS NULL
    ) AS e
    CROSS JOIN clock
    -- Deliveries never produce deliveries.
    WHERE s.agent <> 'webhook'
),
hook_run AS (
    SELECT created.id
    FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM hook)
                     AND (SELECT count(*) FROM counted) + (SELECT count(*) FROM count_insert)
                         >= 0) AS any_hook
    CROSS JOIN LATERAL turnstile_create_runs(
        (SELECT now FROM clock),
        ARRAY(SELECT id FROM hook ORDER BY id),
        ARRAY(SELECT tenant_id FROM hook ORDER BY id),
        ARRAY(SELECT principal FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS uuid) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(10 AS smallint) FROM hook ORDER BY id),
        ARRAY(SELECT CAST('webhook' AS text) FROM hook ORDER BY id),
        -- The input carries its webhook-id and endpoint, so a resubmitted dead letter (a new
        -- run with the same input) sends the same delivery again, with the same webhook-id.
        ARRAY(SELECT jsonb_build_object(
                         'webhook_id', id, 'endpoint_id', endpoint_id,
                         'body', jsonb_build_object('type', event, 'timestamp', now,
                                                    'data', data))
              FROM hook ORDER BY id),
        ARRAY(SELECT CAST(:hook_attempts AS integer) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS timestamptz) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS uuid) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS timestamptz) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS uuid) FROM hook ORDER BY id),
        ARRAY(SELECT CAST(NULL AS text) FROM hook ORDER BY id),
        ARRAY(SELECT jsonb_build_object('webhook', jsonb_build_object(
                         'endpoint_id', endpoint_id, 'source_run_id', source_id,
                         'event', event))
              FROM hook ORDER BY id),
        false, NULL) AS created
),
hook_link AS (
    INSERT INTO webhook_deliveries (run_id, endpoint_id, source_run_id, event, created_at)
    SELECT id, endpoint_id, source_id, event, now FROM hook
)


-- name: enqueue
-- A new queued run (turnstile_create_runs: its event, its first input, its count row, the
-- queued quota: TS429 queue-quota), for back-end services and the core's own callers. A run
-- of a session gets the next run number of its session: the caller holds the session's row
-- lock (a resubmission takes lock_session first).
SELECT r.*,
       -- A run of a session names the session too: its streams, in whichever API process,
       -- look again now; a deadline to start wakes the expirer if it is sooner.
       pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
           'work', jsonb_build_array(r.priority),
           'sessions', CASE WHEN r.session_id IS NOT NULL
                            THEN jsonb_build_array(left(r.session_id::text, 8)) END,
           'start_before', r.start_before))::text)
FROM turnstile_create_runs(
    {{now}}, ARRAY[CAST(:id AS uuid)], ARRAY[CAST(:tenant_id AS text)],
    ARRAY[CAST(:principal AS text)], ARRAY[CAST(:session_id AS uuid)],
    ARRAY[CAST(:priority AS smallint)], ARRAY[CAST(:agent AS text)],
    ARRAY[CAST(:input AS jsonb)], ARRAY[CAST(:max_attempts AS integer)],
    ARRAY[CAST(:scheduled_for AS timestamptz)], ARRAY[CAST(NULL AS uuid)],
    ARRAY[CAST(NULL AS timestamptz)], ARRAY[CAST(:resubmitted_from AS uuid)],
    ARRAY[CAST(:traceparent AS text)],
    -- the key that submitted it (an operator's, on a user's session)
    ARRAY[jsonb_build_object('resubmitted_from', CAST(:resubmitted_from AS uuid),
                             'by', CAST(:actor AS text))],
    -- A resubmitted webhook delivery is exempt from the quota, as deliveries are.
    CAST(:agent AS text) <> 'webhook', CAST(:max_queued AS integer),
    ARRAY[{{start_before}}]) AS r;


-- name: enqueue_many
-- Bulk enqueue of sessionless runs (back-end batches, benchmarks): one statement, one NOTIFY.
-- A batch that would take the tenant past its queued quota is refused whole (TS429).
WITH spec AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:priorities AS smallint[]),
                         CAST(:agents AS text[]), CAST(:inputs AS jsonb[]),
                         CAST(:scheduled AS timestamptz[]))
        WITH ORDINALITY AS s(id, priority, agent, input, scheduled_for, n)
),
run AS (
    SELECT r.id, r.priority FROM turnstile_create_runs(
        {{now}},
        ARRAY(SELECT id FROM spec ORDER BY n),
        ARRAY(SELECT CAST(:tenant_id AS text) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(:principal AS text) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS uuid) FROM spec ORDER BY n),
        ARRAY(SELECT priority FROM spec ORDER BY n),
        ARRAY(SELECT agent FROM spec ORDER BY n),
        ARRAY(SELECT input FROM spec ORDER BY n),
        ARRAY(SELECT CAST(:max_attempts AS integer) FROM spec ORDER BY n),
        ARRAY(SELECT scheduled_for FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS uuid) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS timestamptz) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS uuid) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS text) FROM spec ORDER BY n),
        ARRAY(SELECT CAST(NULL AS jsonb) FROM spec ORDER BY n),
        true, CAST(:max_queued AS integer)) AS r
)
SELECT count(*) AS enqueued,
       pg_notify('turnstile', jsonb_build_object(
           'work', (SELECT jsonb_agg(DISTINCT priority) FROM run))::text) AS notified
FROM run;


-- name: claim
-- The fair claim of up to :limit runs (turnstile_claim: the walk, the limits, the claim
-- itself, docs/adr/0006 and 0009). Always a row: `id` NULL when nothing was claimed, and
-- `passed_over`, the runs it locked but left queued because a concurrent claim had taken
-- their tenant's last room under its limit (the caller asks again at once). No ORDER BY: the
-- caller sorts the batch.
SELECT (c.run).*, c.passed_over
FROM turnstile_claim(:owner, CAST(:priorities AS smallint[]),
                     CAST(:lease_seconds AS double precision), CAST(:limit AS integer),
                     CAST(:max_running AS integer[]), {{now}}, CAST(:claim AS uuid)) AS c;


-- name: claim_fifo
-- The claim without fair shares (QueueConfig.fair_claim off, a test-only switch: it exists so
-- the noisy-neighbour test can show what the fair order changes): up to :limit runs by
-- priority then eligibility time across every tenant, tenants' limits not applied. The
-- running counts are still kept.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
claimed AS (
    UPDATE runs r
    SET status = 'running',
        lease_epoch = r.lease_epoch + 1,
        attempts = r.attempts + 1,
        lease_owner = :owner,
        lease_expires_at = clock.now + make_interval(secs => :lease_seconds),
        last_event_seq = r.last_event_seq + 1,
        started_at = coalesce(r.started_at, clock.now),
        updated_at = clock.now
    FROM clock
    WHERE r.id = ANY(ARRAY(
        SELECT q.id FROM runs q
        WHERE q.status = 'queued'
          AND q.priority = ANY(CAST(:priorities AS smallint[]))
          AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
          AND (q.start_before IS NULL OR q.start_before > {{now}} OR q.started_at IS NOT NULL)
        ORDER BY q.priority, coalesce(q.scheduled_for, q.created_at)
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING r.*
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT claimed.id, claimed.last_event_seq, 'run.claimed', claimed.lease_epoch,
           jsonb_build_object('attempt', claimed.attempts, 'owner', claimed.lease_owner,
                              'lease_expires_at', claimed.lease_expires_at),
           clock.now
    FROM claimed, clock
),
moves AS (
    SELECT tenant_id, priority / 10 AS band, 1 AS d_running,
           CAST(NULL AS timestamptz) AS requeued_at
    FROM claimed
),
{{count_moves}}
SELECT claimed.* FROM claimed;


-- name: next_due
-- How long until the earliest queued run of the given priorities that is not eligible yet
-- becomes eligible (a scheduled run, a schedule's tick, a backed-off retry); NULL when there is
-- none. A claim loop that found nothing sleeps until then rather than a whole poll interval,
-- so such runs start on time without a notification each. One probe of the claim index per
-- priority (its leading column), reading its first row past now: no scan of the queue.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now)
SELECT extract(epoch FROM min(due.at) - clock.now) AS seconds
FROM clock, unnest(CAST(:priorities AS smallint[])) AS p(priority)
CROSS JOIN LATERAL (
    SELECT coalesce(q.scheduled_for, q.created_at) AS at FROM runs q
    WHERE q.status = 'queued'
      AND q.priority = p.priority
      AND coalesce(q.scheduled_for, q.created_at) > clock.now
    ORDER BY coalesce(q.scheduled_for, q.created_at)
    LIMIT 1
) AS due
GROUP BY clock.now;


-- name: heartbeat_many
-- fenced
-- One statement per worker process per beat, whatever its number of runs; each run is fenced
-- on its own (run id, epoch) pair, and the pairs not returned have been lost. A process can
-- hold two executions of one run (a stale one the sweeper requeued, and its new claim), so
-- results are (id, epoch) pairs, never ids alone.
WITH held AS (
    SELECT * FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]))
        AS h(run_id, epoch)
),
locked AS MATERIALIZED (
    -- Rows in id order first (see the header): complete_many of the same process takes them
    -- in the same order, so the two can no longer deadlock. Only rows still held under the
    -- given epochs: a run another worker holds now is not this statement's to lock.
    SELECT r.id FROM runs r
    JOIN held ON r.id = held.run_id AND r.lease_epoch = held.epoch AND r.status = 'running'
    ORDER BY r.id
    FOR UPDATE OF r
)
UPDATE runs r
SET lease_expires_at = {{now}} + make_interval(secs => :lease_seconds)
FROM held, locked
WHERE r.id = locked.id
  AND r.id = held.run_id AND r.lease_epoch = held.epoch AND r.status = 'running'
RETURNING r.id, r.lease_epoch, r.lease_expires_at;


-- name: append_event
-- fenced
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
)
INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
SELECT run.id, run.last_event_seq, :type, run.lease_epoch, CAST(:data AS jsonb), clock.now
FROM run, clock
RETURNING seq;


-- name: tool_started
-- fenced
-- Journal first, tool second: recovery trusts a 'started' entry without a 'finished' one to
-- mean "may have run", and the tool's idempotency class decides what happens next.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'tool.started', run.lease_epoch,
           jsonb_build_object('step', CAST(:step AS integer), 'tool', CAST(:tool AS text),
                              'idempotency_class', CAST(:idempotency_class AS text),
                              'idempotency_key', CAST(:idempotency_key AS text),
                              'args', CAST(:args AS jsonb)),
           clock.now
    FROM run, clock
)
INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                          idempotency_key, args, created_at)
SELECT run.id, run.last_event_seq, run.lease_epoch, :step, 'started', :tool,
       :idempotency_class, :idempotency_key, CAST(:args AS jsonb), clock.now
FROM run, clock
RETURNING event_seq AS seq;


-- name: tool_finished
-- fenced
-- The outcome, its event and the checkpoint at this tool-invocation boundary commit together:
-- a recovered run either sees all three or none.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'tool.finished', run.lease_epoch,
           jsonb_build_object('step', CAST(:step AS integer), 'tool', CAST(:tool AS text),
                              'idempotency_class', CAST(:idempotency_class AS text),
                              'outcome_status', CAST(:outcome_status AS text),
                              'outcome', CAST(:outcome AS jsonb)),
           clock.now
    FROM run, clock
),
journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT run.id, run.last_event_seq, run.lease_epoch, :step, 'finished', :tool,
           :idempotency_class, :idempotency_key, :outcome_status, CAST(:outcome AS jsonb),
           clock.now
    FROM run, clock
)
INSERT INTO checkpoints (run_id, event_seq, epoch, step, state, created_at)
SELECT run.id, run.last_event_seq, run.lease_epoch, :step, CAST(:state AS jsonb), clock.now
FROM run, clock
RETURNING event_seq AS seq;


-- name: tool_rejected
-- fenced
-- A call the user refused before it ran (docs/approvals.md): one 'finished' journal entry
-- (status rejected) that also keeps the call's arguments, for the transcript, since no
-- 'started' entry will; its tool.finished event and the checkpoint, together. Never open, so
-- neither recovery nor an ending statement takes it for a call that may have run.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'tool.finished', run.lease_epoch,
           jsonb_build_object('step', CAST(:step AS integer), 'tool', CAST(:tool AS text),
                              'idempotency_class', CAST(:idempotency_class AS text),
                              'outcome_status', 'rejected',
                              'outcome', CAST(:outcome AS jsonb)),
           clock.now
    FROM run, clock
),
journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              args, outcome_status, outcome, created_at)
    SELECT run.id, run.last_event_seq, run.lease_epoch, :step, 'finished', :tool,
           :idempotency_class, CAST(:args AS jsonb), 'rejected', CAST(:outcome AS jsonb),
           clock.now
    FROM run, clock
)
INSERT INTO checkpoints (run_id, event_seq, epoch, step, state, created_at)
SELECT run.id, run.last_event_seq, run.lease_epoch, :step, CAST(:state AS jsonb), clock.now
FROM run, clock
RETURNING event_seq AS seq;


-- name: tool_not_sent
-- fenced
-- Closes a started call whose transient errors prove the request never reached its target and
-- whose retries ran out. Not 'finished' (the next attempt would take the step as done and the
-- run could succeed with a tool that never ran) and not open (recovery would report an unsafe
-- call 'uncertain'): the next attempt plans the call again. No checkpoint: the step is undone.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'tool.not_sent', run.lease_epoch,
           jsonb_build_object('step', CAST(:step AS integer), 'tool', CAST(:tool AS text),
                              'idempotency_class', CAST(:idempotency_class AS text),
                              'error', CAST(:error AS text)),
           clock.now
    FROM run, clock
)
INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                          idempotency_key, outcome, created_at)
SELECT run.id, run.last_event_seq, run.lease_epoch, :step, 'not_sent', :tool,
       :idempotency_class, :idempotency_key, jsonb_build_object('error', CAST(:error AS text)),
       clock.now
FROM run, clock
RETURNING event_seq AS seq;


-- name: take_steered
-- fenced
-- Steered turns (docs/turn-control.md) reach the running run at a decision boundary: each
-- becomes one of its inputs (run_inputs, so the transcript and the next run's history have
-- it) with its run.input_delivered event (policy steer), and its pending turn is marked
-- delivered with the input's index and the step the run was at. Locks the run row, then the
-- pending turns (the ending statements' order). Always a row while the fence holds (inputs
-- '[]' when there was nothing to take); none when fenced.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
held AS MATERIALIZED (
    SELECT id, session_id, last_event_seq, inputs_count FROM runs
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    FOR UPDATE
),
steer_locked AS MATERIALIZED (
    SELECT p.id, p.seq, p.input, p.submitted_by FROM held
    JOIN pending_turns p ON p.session_id = held.session_id
    WHERE p.status = 'pending' AND p.policy = 'steer'
    ORDER BY p.seq
    FOR UPDATE OF p
),
steered AS MATERIALIZED (
    SELECT s.*, row_number() OVER (ORDER BY s.seq) AS n FROM steer_locked s
),
run AS (
    UPDATE runs r
    SET last_event_seq = r.last_event_seq + t.n,
        inputs_count = r.inputs_count + t.n,
        updated_at = clock.now
    FROM held, clock, (SELECT count(*) AS n FROM steered) AS t
    WHERE r.id = held.id AND r.lease_epoch = :epoch AND r.status = 'running' AND t.n > 0
    RETURNING r.id, r.lease_epoch, held.last_event_seq AS seq_before,
              held.inputs_count AS inputs_before
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.seq_before + s.n, 'run.input_delivered', run.lease_epoch,
           jsonb_build_object('input_index', run.inputs_before + s.n,
                              'principal', s.submitted_by, 'policy', 'steer',
                              'pending_turn_id', s.id, 'at_step', CAST(:at_step AS integer)),
           clock.now
    FROM run, steered s, clock
),
answer AS (
    INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
    SELECT run.id, run.inputs_before + s.n, s.input, s.submitted_by, run.seq_before + s.n,
           clock.now
    FROM run, steered s, clock
),
delivered AS (
    UPDATE pending_turns p
    SET status = 'delivered', run_id = run.id, input_idx = run.inputs_before + s.n,
        at_step = :at_step, updated_at = clock.now
    FROM run, steered s, clock
    WHERE p.id = s.id
)
SELECT held.id,
       coalesce((SELECT jsonb_agg(s.input ORDER BY s.n) FROM steered s), '[]'::jsonb)
           AS inputs
FROM held;


-- name: save_checkpoint
-- fenced
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
    RETURNING id, last_event_seq, lease_epoch
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.checkpoint', run.lease_epoch,
           jsonb_build_object('step', CAST(:step AS integer)), clock.now
    FROM run, clock
)
INSERT INTO checkpoints (run_id, event_seq, epoch, step, state, created_at)
SELECT run.id, run.last_event_seq, run.lease_epoch, :step, CAST(:state AS jsonb), clock.now
FROM run, clock
RETURNING event_seq AS seq;


-- name: end_holds
-- fenced
-- The one statement that ends workers' holds (docs/adr/0010), for a batch of (run, epoch,
-- outcome), each run fenced on its own pair, as River's JobSetStateIfRunningMany ends jobs:
--   succeeded  the run's result (:values), terminal;
--   failed     a permanent failure (:values), terminal whatever attempts remain (decision 5);
--   waiting    a question for the user (:values) with the checkpoint at :steps/:states: the
--              lease is given up and attempts restart from 0 (a question is not a failure);
--   released   a graceful release (drain): queued at once, the claim given back;
--   capacity   a wait for model capacity (docs/model-budgets.md): like released, but queued
--              for the time in :values (until), when the endpoint's budget has room again;
--   retry      transient retries ran out: queued with backoff, counted like a lost lease, or
--              dead-lettered on the last attempt ('attempts_exhausted');
--   expired    the sweeper's, for a run whose lease deadline passed (also fenced on it):
--              queued with backoff, or dead-lettered on the last attempt ('lease_expired').
-- Only `retry` and `expired` compare attempts with max_attempts. A run dead-lettered or
-- failed in the middle of a call (journal 'started' with no later entry for its step) gets,
-- before its run.failed, a journal outcome with its own tool.finished event for each such
-- call: 'uncertain' for an unsafe one, which its failure names, 'abandoned' for a safe or
-- keyed one (repeating it is harmless): nobody will recover it, so this is the last chance to
-- say what became of it, and the transcript never holds a call without its outcome. A requeued run leaves them to its next attempt's
-- recovery. A run whose fence does not match (reclaimed, cancelled, finished) is not written
-- and is missing from the result: its caller gets Fenced. Every side effect of an end is
-- written here once: its event, its count row, the webhook deliveries of terminal and waiting
-- runs, and one bounded notification.
-- The sweeper runs it after lock_expired, in the same transaction: the runs are locked, so no
-- worker can commit a write for them any more, and this statement's fresh snapshot sees every
-- journal entry committed before the lock.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
held AS (
    SELECT * FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]),
                         CAST(:outcomes AS text[]), CAST(:values AS jsonb[]),
                         CAST(:steps AS integer[]), CAST(:states AS jsonb[]))
        AS h(run_id, epoch, outcome, value, step, state)
),
locked AS MATERIALIZED (
    -- Rows in id order first (see the header), only rows still held under the given epochs.
    SELECT r.id, h.outcome, h.value, h.step, h.state,
           CASE h.outcome
               WHEN 'succeeded' THEN 'succeeded'
               WHEN 'failed' THEN 'failed'
               WHEN 'waiting' THEN 'waiting_for_user'
               WHEN 'released' THEN 'queued'
               WHEN 'capacity' THEN 'queued'
               ELSE CASE WHEN r.attempts >= r.max_attempts THEN 'failed' ELSE 'queued' END
           END AS status
    FROM runs r
    JOIN held h ON r.id = h.run_id AND r.lease_epoch = h.epoch AND r.status = 'running'
    CROSS JOIN clock
    WHERE h.outcome IN ('succeeded', 'failed', 'waiting', 'released', 'capacity', 'retry')
       OR (h.outcome = 'expired' AND r.lease_expires_at < clock.now)
    ORDER BY r.id
    FOR UPDATE OF r
),
open_calls AS MATERIALIZED (
    SELECT j.run_id, j.step, j.tool, j.idempotency_class, j.idempotency_key,
           {{settled_outcome}},
           row_number() OVER (PARTITION BY j.run_id ORDER BY j.event_seq) AS n
    FROM locked
    JOIN tool_journal j ON j.run_id = locked.id
    WHERE locked.status = 'failed' AND j.entry = 'started'
      AND NOT EXISTS (SELECT 1 FROM tool_journal later
                      WHERE later.run_id = j.run_id AND later.step = j.step
                        AND later.event_seq > j.event_seq)
),
open_per_run AS (
    -- Every open call takes an event; the failure names the unsafe ones only.
    SELECT run_id, count(*) AS calls,
           jsonb_agg(jsonb_build_object('step', step, 'tool', tool) ORDER BY n)
               FILTER (WHERE settled = 'uncertain') AS described,
           string_agg(format('%s (step %s)', tool, step), ', ' ORDER BY n)
               FILTER (WHERE settled = 'uncertain') AS named
    FROM open_calls
    GROUP BY run_id
),
decided AS MATERIALIZED (
    SELECT l.*, r.attempts, r.max_attempts, r.lease_owner, r.agent,
           coalesce(o.calls, 0) AS open_calls, o.described, o.named,
           -- A webhook delivery has its own backoff: a receiver may be down for hours.
           CASE WHEN r.agent = 'webhook'
                THEN least(CAST(:hook_backoff_max AS double precision),
                           :hook_backoff_base * power(2, r.attempts - 1))
                ELSE least(CAST(:backoff_max AS double precision),
                           :backoff_base * power(2, r.attempts - 1))
           END AS backoff
    FROM locked l JOIN runs r ON r.id = l.id
    LEFT JOIN open_per_run o ON o.run_id = l.id
),
ended AS (
    UPDATE runs r
    SET status = d.status,
        result = CASE WHEN d.outcome = 'succeeded' THEN d.value ELSE r.result END,
        failure = CASE
            WHEN d.status <> 'failed' THEN r.failure
            WHEN d.outcome = 'failed' AND d.named IS NULL THEN d.value
            WHEN d.outcome = 'failed' THEN d.value || jsonb_build_object(
                'message', coalesce(d.value ->> 'message', '') || '; outcome unknown of '
                           || d.named,
                'uncertain_calls', d.described)
            ELSE jsonb_strip_nulls(jsonb_build_object(
                'kind', CASE d.outcome WHEN 'retry' THEN 'attempts_exhausted'
                                       ELSE 'lease_expired' END,
                'message', CASE d.outcome
                    WHEN 'retry' THEN format('transient errors on attempt %s of %s: %s',
                                             r.attempts, r.max_attempts, d.value ->> 'reason')
                    ELSE format('lease expired on attempt %s of %s (last owner %s)',
                                r.attempts, r.max_attempts, r.lease_owner)
                END || coalesce('; outcome unknown of ' || d.named, ''),
                'attempts', r.attempts,
                'uncertain_calls', d.described))
        END,
        question = CASE WHEN d.outcome = 'waiting' THEN d.value END,
        attempts = CASE d.outcome WHEN 'waiting' THEN 0
                                  WHEN 'released' THEN greatest(r.attempts - 1, 0)
                                  WHEN 'capacity' THEN greatest(r.attempts - 1, 0)
                                  ELSE r.attempts END,
        scheduled_for = CASE WHEN d.outcome IN ('retry', 'expired') AND d.status = 'queued'
                             THEN clock.now + make_interval(secs => d.backoff)
                             WHEN d.outcome = 'capacity'
                             THEN greatest(clock.now, CAST(d.value ->> 'until' AS timestamptz))
                             ELSE r.scheduled_for END,
        finished_at = CASE WHEN d.status IN ('succeeded', 'failed') THEN clock.now END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        -- One event per open call, then the run's own.
        last_event_seq = r.last_event_seq + 1 + d.open_calls,
        updated_at = clock.now
    FROM decided d, clock
    WHERE r.id = d.id
    RETURNING r.id, r.status, r.last_event_seq, r.lease_epoch, r.priority, r.attempts,
              r.scheduled_for, r.result, r.failure, r.question, r.tenant_id, r.agent,
              r.session_id, d.outcome, d.step, d.state, d.value, d.open_calls
),
settled_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT e.id, e.last_event_seq - e.open_calls - 1 + c.n, 'tool.finished', e.lease_epoch,
           jsonb_build_object('step', c.step, 'tool', c.tool,
                              'idempotency_class', c.idempotency_class,
                              'outcome_status', c.settled,
                              'outcome', {{settled_message}})
           || CASE WHEN e.outcome = 'expired' THEN '{"by": "sweeper"}'::jsonb
                   ELSE '{}'::jsonb END,
           clock.now
    FROM ended e JOIN open_calls c ON c.run_id = e.id, clock
),
settled_journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT e.id, e.last_event_seq - e.open_calls - 1 + c.n, e.lease_epoch, c.step, 'finished',
           c.tool, c.idempotency_class, c.idempotency_key, c.settled, {{settled_message}},
           clock.now
    FROM ended e JOIN open_calls c ON c.run_id = e.id, clock
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT e.id, e.last_event_seq,
           CASE WHEN e.status = 'succeeded' THEN 'run.succeeded'
                WHEN e.status = 'failed' THEN 'run.failed'
                WHEN e.status = 'waiting_for_user' THEN 'run.waiting'
                WHEN e.outcome = 'expired' THEN 'run.requeued'
                ELSE 'run.released' END,
           e.lease_epoch,
           CASE WHEN e.status = 'succeeded' THEN jsonb_build_object('result', e.result)
                WHEN e.status = 'failed' THEN jsonb_build_object('failure', e.failure)
                WHEN e.status = 'waiting_for_user'
                    THEN jsonb_build_object('question', e.question, 'step', e.step)
                         -- A wait for a tool call's approval names it (docs/approvals.md).
                         || CASE WHEN e.question -> 'approval_request' IS NOT NULL
                                 THEN jsonb_build_object('approval_request',
                                                         e.question -> 'approval_request')
                                 ELSE '{}'::jsonb END
                WHEN e.outcome = 'released'
                    THEN jsonb_build_object('graceful', true, 'attempts', e.attempts,
                                            'reason', e.value ->> 'reason')
                WHEN e.outcome = 'capacity'
                    THEN jsonb_build_object('graceful', true, 'attempts', e.attempts,
                                            'reason', e.value ->> 'reason',
                                            'waited_for', 'capacity',
                                            'endpoint', e.value ->> 'endpoint',
                                            'retry_at', e.scheduled_for)
                WHEN e.outcome = 'retry'
                    THEN jsonb_build_object('graceful', false, 'attempts', e.attempts,
                                            'retry_at', e.scheduled_for,
                                            'reason', e.value ->> 'reason')
                ELSE jsonb_build_object('reason', 'lease_expired', 'attempts', e.attempts,
                                        'retry_at', e.scheduled_for)
           END,
           clock.now
    FROM ended e, clock
),
checkpoint AS (
    INSERT INTO checkpoints (run_id, event_seq, epoch, step, state, created_at)
    SELECT e.id, e.last_event_seq, e.lease_epoch, e.step, e.state, clock.now
    FROM ended e, clock WHERE e.outcome = 'waiting'
),
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running,
           CASE WHEN status = 'queued' THEN coalesce(scheduled_for, clock.now) END
               AS requeued_at
    FROM ended, clock
),
{{count_moves}},
hook_source AS (
    -- Terminal and waiting runs; a requeue is not a transition webhooks see.
    SELECT id AS run_id, tenant_id, agent,
           CASE status WHEN 'succeeded' THEN 'run.succeeded' WHEN 'failed' THEN 'run.failed'
                       ELSE 'run.waiting' END AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', status)
           || CASE status WHEN 'succeeded' THEN jsonb_build_object('result', result)
                          WHEN 'failed' THEN jsonb_build_object('failure', failure)
                          ELSE jsonb_build_object('question', question)
                               || CASE WHEN question -> 'approval_request' IS NOT NULL
                                       THEN jsonb_build_object('approval_request',
                                                               question -> 'approval_request')
                                       ELSE '{}'::jsonb END END AS data
    FROM ended WHERE status IN ('succeeded', 'failed', 'waiting_for_user')
),
{{webhook_deliveries}},
promoted AS (
    -- A session whose run ended for good starts its next pending turn, in this transaction
    -- (turnstile_promote_turns; docs/turn-control.md). After the count moves, as hook_run.
    SELECT p.id
    FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM ended
                                 WHERE session_id IS NOT NULL
                                   AND status IN ('succeeded', 'failed'))
                     AND (SELECT count(*) FROM counted) + (SELECT count(*) FROM count_insert)
                         >= 0) AS any_ended
    CROSS JOIN LATERAL turnstile_promote_turns(
        (SELECT now FROM clock),
        ARRAY(SELECT session_id FROM ended
              WHERE session_id IS NOT NULL AND status IN ('succeeded', 'failed'))) AS p
)

-- One row whatever the batch: the written runs as parallel arrays ((id, epoch) names a write:
-- one process may hold a stale and a fresh execution of one run), and one bounded NOTIFY
-- (none when nothing was written): requeues wake claimers by priority, terminal and waiting
-- runs their watchers by id prefix.
SELECT coalesce(array_agg(e.id), '{}') AS ids,
       coalesce(array_agg(e.lease_epoch), '{}') AS epochs,
       coalesce(array_agg(e.last_event_seq), '{}') AS seqs,
       coalesce(array_agg(e.status), '{}') AS statuses,
       coalesce(array_agg(e.priority), '{}') AS priorities,
       CASE WHEN count(*) > 0 THEN pg_notify('turnstile', (jsonb_build_object(
           'runs', coalesce((SELECT jsonb_agg(left(named.id::text, 8))
                             FROM (SELECT id FROM ended WHERE status <> 'queued' LIMIT 500)
                                 AS named), '[]'::jsonb),
           'more', count(*) FILTER (WHERE e.status <> 'queued') > 500)
           || CASE WHEN count(*) FILTER (WHERE e.status = 'queued') > 0 OR EXISTS (SELECT 1 FROM hook)
                   THEN jsonb_build_object('work',
                       coalesce((SELECT jsonb_agg(DISTINCT priority) FROM ended
                                 WHERE status = 'queued'), '[]'::jsonb)
                       || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '[10]'::jsonb
                               ELSE '[]'::jsonb END)
                   ELSE '{}'::jsonb END)::text) END AS notified
FROM ended e
CROSS JOIN (SELECT count(*) FROM hook_run) AS delivered
CROSS JOIN (SELECT count(*) FROM promoted) AS started;


-- name: record_fenced
-- The one write a fenced worker still makes (exempt from the fence by definition): an event
-- carrying its stale epoch, so a lost lease is visible in the run's log. It changes nothing in
-- the run but the event counter.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs
    SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id
    RETURNING id, last_event_seq, lease_epoch, status, priority
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.fenced', :epoch,
           jsonb_build_object('stale_epoch', CAST(:epoch AS bigint), 'current_epoch', run.lease_epoch,
                              'status', run.status, 'owner', CAST(:owner AS text),
                              'during', CAST(:during AS text)),
           clock.now
    FROM run, clock
)
SELECT run.last_event_seq AS seq, run.priority FROM run;


-- name: lock_expired
-- The sweeper's first step: up to :limit running runs whose lease deadline passed, oldest
-- deadline first, locked for this transaction, with the epoch end_holds then fences them on.
-- SKIP LOCKED lets two sweepers, or a sweeper and a worker writing its last heartbeat, pass
-- each other. The epoch is not bumped by the sweep: the status change alone fences the old
-- holder (its fence requires 'running'), and the next claim bumps it.
SELECT id, lease_epoch FROM runs
WHERE status = 'running' AND lease_expires_at < {{now}}
ORDER BY lease_expires_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;


-- name: overdue_runs
-- The expirer's first step (docs/start-deadlines.md): a batch of queued runs never claimed
-- whose deadline to start has passed, earliest first, from ix_runs_start_before. Not locked
-- here: cancel_runs checks each again on the row it locks.
SELECT id FROM runs
WHERE status = 'queued' AND started_at IS NULL AND start_before <= {{now}}
ORDER BY start_before
LIMIT :limit;


-- name: next_start_deadline
-- How long until the earliest deadline to start of a queued run never claimed (negative when
-- passed); no row when there is none. The expirer sleeps until then: one probe of
-- ix_runs_start_before.
SELECT extract(epoch FROM r.start_before - {{now}}) AS seconds FROM runs r
WHERE r.status = 'queued' AND r.started_at IS NULL AND r.start_before IS NOT NULL
ORDER BY r.start_before
LIMIT 1;


-- name: deliver_input
-- An answer to a run waiting for the user (turnstile_deliver_input): the same run back to the
-- queue; no row when it is not waiting.
SELECT r.*,
       pg_notify('turnstile', jsonb_build_object(
           'work', jsonb_build_array(r.priority),
           'runs', jsonb_build_array(left(r.id::text, 8)))::text)
FROM turnstile_deliver_input({{now}}, CAST(:run_id AS uuid), CAST(:input AS jsonb),
                             CAST(:principal AS text), CAST(:traceparent AS text)) AS r;


-- name: cancel_runs
-- Cancellation from any non-terminal status, for a batch of runs (an operator's cancel of one,
-- a deleted endpoint's pending deliveries a batch at a time): cancelled, lease cleared, epoch
-- bumped (a worker executing the run is fenced at its next write or heartbeat), run.cancelled
-- written, the webhook deliveries it reports, its count row, one bounded notification. Runs
-- not visible to :tenant_id and :principal (NULL: any), missing or finished are left alone
-- and not returned; the caller reads which.
-- A call left open (journal 'started' with no later entry for its step: in flight in a worker
-- being fenced now, or left by a lost lease for a recovery that will never run) gets a journal
-- outcome and its own tool.finished event before run.cancelled, as a dead letter's do:
-- 'uncertain' when unsafe, 'abandoned' when safe or keyed. Nobody will settle it later, and
-- without it the transcript and the session's next run would not know the call was made. The worker's own outcome for it, if
-- it ever comes, is fenced. The entries carry the epoch the call was made in (the one before
-- this cancel's bump), as the sweeper's do; having no checkpoint, they are never taken for
-- the worker's own by recognise_tool_finished.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
locked AS MATERIALIZED (
    -- The runs' status as it is when locked (a claim may commit while this waits for a row):
    -- the counts move from that status, not from the one in this statement's snapshot.
    SELECT id, status AS was FROM runs
    WHERE id = ANY(CAST(:run_ids AS uuid[]))
      AND status IN ('queued', 'running', 'waiting_for_user')
      AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
      AND (CAST(:principal AS text) IS NULL OR principal = :principal)
      -- The expirer's cancel (overdue true, reason 'expired'): only a run still queued and
      -- never claimed whose deadline to start has passed, checked on the row as locked (a
      -- claim that committed meanwhile has started it: it is left alone).
      AND (NOT CAST(:overdue AS boolean)
           OR (status = 'queued' AND started_at IS NULL AND start_before <= {{now}}))
    ORDER BY id
    FOR UPDATE
),
open_calls AS MATERIALIZED (
    -- Read after the rows are locked: every journal entry a worker committed before is seen.
    SELECT j.run_id, j.step, j.tool, j.idempotency_class, j.idempotency_key,
           {{settled_outcome}},
           row_number() OVER (PARTITION BY j.run_id ORDER BY j.event_seq) AS n
    FROM locked
    JOIN tool_journal j ON j.run_id = locked.id
    WHERE j.entry = 'started'
      AND NOT EXISTS (SELECT 1 FROM tool_journal later
                      WHERE later.run_id = j.run_id AND later.step = j.step
                        AND later.event_seq > j.event_seq)
),
open_per_run AS (
    SELECT run_id, count(*) AS calls FROM open_calls GROUP BY run_id
),
run AS (
    UPDATE runs r
    SET status = 'cancelled',
        lease_epoch = r.lease_epoch + 1,
        lease_owner = NULL,
        lease_expires_at = NULL,
        question = NULL,
        finished_at = clock.now,
        -- One event per open call, then run.cancelled.
        last_event_seq = r.last_event_seq + 1 + coalesce(o.calls, 0),
        updated_at = clock.now
    FROM clock, locked
    LEFT JOIN open_per_run o ON o.run_id = locked.id
    WHERE r.id = locked.id AND r.status IN ('queued', 'running', 'waiting_for_user')
    RETURNING r.*, coalesce(o.calls, 0) AS open_calls
),
settled_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + c.n, 'tool.finished',
           run.lease_epoch - 1,
           jsonb_build_object('step', c.step, 'tool', c.tool,
                              'idempotency_class', c.idempotency_class,
                              'outcome_status', c.settled,
                              'outcome', {{settled_message}},
                              'by', 'cancel'),
           clock.now
    FROM run JOIN open_calls c ON c.run_id = run.id, clock
),
settled_journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + c.n, run.lease_epoch - 1, c.step,
           'finished', c.tool, c.idempotency_class, c.idempotency_key, c.settled,
           {{settled_message}}, clock.now
    FROM run JOIN open_calls c ON c.run_id = run.id, clock
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.cancelled', run.lease_epoch,
           jsonb_build_object('by', CAST(:actor AS text), 'reason', CAST(:reason AS text)),
           clock.now
    FROM run, clock
),
moves AS (
    SELECT run.tenant_id, run.priority / 10 AS band,
           CASE WHEN locked.was = 'running' THEN -1 ELSE 0 END AS d_running,
           CAST(NULL AS timestamptz) AS requeued_at
    FROM run JOIN locked ON locked.id = run.id
),
{{count_moves}},
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.cancelled' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'cancelled',
                              'reason', CAST(:reason AS text)) AS data
    FROM run
),
{{webhook_deliveries}},
promoted AS (
    -- Each cancelled run's session starts its next pending turn (an interrupt's first), in
    -- this transaction (turnstile_promote_turns; docs/turn-control.md).
    SELECT p.id
    FROM (SELECT 1 WHERE EXISTS (SELECT 1 FROM run WHERE session_id IS NOT NULL)
                     AND (SELECT count(*) FROM counted) + (SELECT count(*) FROM count_insert)
                         >= 0) AS any_ended
    CROSS JOIN LATERAL turnstile_promote_turns(
        (SELECT now FROM clock),
        ARRAY(SELECT session_id FROM run WHERE session_id IS NOT NULL)) AS p
),
notice AS MATERIALIZED (
    SELECT pg_notify('turnstile', (jsonb_build_object(
               'runs', (SELECT jsonb_agg(left(named.id::text, 8))
                        FROM (SELECT id FROM run LIMIT 500) AS named))
               || CASE WHEN (SELECT count(*) FROM run) > 500 THEN '{"more": true}'::jsonb
                       ELSE '{}'::jsonb END
               || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb
                       ELSE '{}'::jsonb END)::text) AS notified
    FROM (SELECT count(*) FROM hook_run) AS delivered
    WHERE EXISTS (SELECT 1 FROM run)
)
-- A cross join, not a left one: the planner removes a left join to a one-row subquery whose
-- columns are not read, and `promoted` would then never run.
SELECT run.* FROM run LEFT JOIN notice ON true
CROSS JOIN (SELECT count(*) AS promoted FROM promoted) AS started;

-- ============================================================================================
-- Replays of fenced writes whose outcome is unknown (docs/adr/0002, "Replays").
-- A fenced write whose connection died after it was sent may have committed. It is sent again
-- only in a transaction of its own that first takes the run row (`lock_for_replay`: a first
-- sending still running on the server commits or aborts before what follows reads), then asks
-- the write's recognising read below whether that first sending committed. A row back is the
-- earlier write's own result, in the columns the write returns; no row, and the write itself
-- runs in the same transaction. The writes themselves are unchanged, so the normal path pays
-- nothing. Each read names what only that write leaves behind under its epoch (the sweeper
-- also writes events with the holder's epoch: run.failed, run.requeued, uncertain
-- tool.finished, none of which a read below takes for the holder's own).
-- ============================================================================================


-- name: lock_for_replay
SELECT id FROM runs WHERE id = :run_id FOR UPDATE;


-- name: lock_many_for_replay
-- complete_many's replay: its rows in id order, as every multi-row statement takes them.
SELECT id FROM runs WHERE id = ANY(CAST(:run_ids AS uuid[])) ORDER BY id FOR UPDATE;


-- name: recognise_append_event
-- The run's latest event of this epoch is this one (type and data). The holder writes one
-- fenced statement at a time and replays at once, so its earlier sending, if committed, is
-- its latest event; an identical event just before an uncommitted one would be taken for it.
SELECT e.seq FROM run_events e
WHERE e.run_id = :run_id
  AND e.seq = (SELECT max(l.seq) FROM run_events l
               WHERE l.run_id = :run_id AND l.epoch = :epoch)
  AND e.type = :type AND e.data = CAST(:data AS jsonb);


-- name: recognise_tool_started
-- A step is journalled 'started' at most once per epoch (a retry inside the run reuses the
-- entry; recovery starts an earlier epoch's step under the new one), and only by its holder.
SELECT j.event_seq AS seq FROM tool_journal j
WHERE j.run_id = :run_id AND j.epoch = :epoch AND j.step = :step AND j.entry = 'started';


-- name: recognise_tool_finished
-- The step's 'finished' entry of this epoch with its checkpoint: the sweeper's and the
-- dead-lettering transitions' 'uncertain' entries have none.
SELECT j.event_seq AS seq FROM tool_journal j
JOIN checkpoints c ON c.run_id = j.run_id AND c.event_seq = j.event_seq
WHERE j.run_id = :run_id AND j.epoch = :epoch AND j.step = :step AND j.entry = 'finished';


-- name: recognise_tool_not_sent
SELECT j.event_seq AS seq FROM tool_journal j
WHERE j.run_id = :run_id AND j.epoch = :epoch AND j.step = :step AND j.entry = 'not_sent';


-- name: recognise_tool_rejected
-- The refusal's journal entry of this epoch and step (its event and checkpoint committed with it).
SELECT j.event_seq AS seq FROM tool_journal j
WHERE j.run_id = :run_id AND j.epoch = :epoch AND j.step = :step AND j.entry = 'finished'
  AND j.outcome_status = 'rejected';


-- name: recognise_save_checkpoint
-- As append_event: the latest event of this epoch is this checkpoint (step and state).
SELECT e.seq FROM run_events e
JOIN checkpoints c ON c.run_id = e.run_id AND c.event_seq = e.seq
WHERE e.run_id = :run_id
  AND e.seq = (SELECT max(l.seq) FROM run_events l
               WHERE l.run_id = :run_id AND l.epoch = :epoch)
  AND e.type = 'run.checkpoint' AND c.step = :step AND c.state = CAST(:state AS jsonb);


-- name: recognise_claim
-- The runs a claim of unknown outcome took (its answer was lost after it committed): still
-- running under the epoch of the run.claimed event that names the claim's id. A claim is not
-- sent again (a second one would take other runs); what this finds is the first one's result.
-- The owner's running runs first (a worker's few), then each one's claim event by key.
SELECT r.*, 0 AS passed_over FROM runs r
WHERE r.status = 'running' AND r.lease_owner = :owner
  AND EXISTS (SELECT 1 FROM run_events e
              WHERE e.run_id = r.id AND e.epoch = r.lease_epoch AND e.type = 'run.claimed'
                AND e.data ->> 'claim' = CAST(CAST(:claim AS uuid) AS text));


-- name: recognise_end_holds
-- end_holds' read for each (run, epoch, outcome) of a batch, in end_holds' result shape: the
-- event only that end writes under that epoch. run.succeeded and run.waiting are written only
-- by the holder; run.failed by the holder's permanent failure carries the kind it gave (the
-- sweeper's dead letter is 'lease_expired', an early release's 'attempts_exhausted'); a
-- release says whether it was graceful. The sweeper's own ends are not replayed (its next
-- pass finds what this one left).
SELECT coalesce(array_agg(e.run_id), '{}') AS ids,
       coalesce(array_agg(e.epoch), '{}') AS epochs,
       coalesce(array_agg(e.seq), '{}') AS seqs,
       coalesce(array_agg(CASE e.type WHEN 'run.succeeded' THEN 'succeeded'
                                      WHEN 'run.failed' THEN 'failed'
                                      WHEN 'run.waiting' THEN 'waiting_for_user'
                                      ELSE 'queued' END), '{}') AS statuses,
       coalesce(array_agg(r.priority), '{}') AS priorities
FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]), CAST(:outcomes AS text[]),
            CAST(:values AS jsonb[])) AS h(run_id, epoch, outcome, value)
JOIN run_events e ON e.run_id = h.run_id AND e.epoch = h.epoch
 AND CASE h.outcome
         WHEN 'succeeded' THEN e.type = 'run.succeeded'
         WHEN 'waiting' THEN e.type = 'run.waiting'
         WHEN 'failed' THEN e.type = 'run.failed'
             AND (e.data -> 'failure' ->> 'kind') IS NOT DISTINCT FROM (h.value ->> 'kind')
         WHEN 'released' THEN e.type = 'run.released' AND e.data ->> 'graceful' = 'true'
         WHEN 'capacity' THEN e.type = 'run.released' AND e.data ->> 'waited_for' = 'capacity'
         WHEN 'retry' THEN (e.type = 'run.released' AND e.data ->> 'graceful' = 'false')
             OR (e.type = 'run.failed'
                 AND e.data -> 'failure' ->> 'kind' = 'attempts_exhausted')
         ELSE false
     END
JOIN runs r ON r.id = h.run_id;
