-- Turnstile's run transitions: every statement that changes a run's state, in one place
-- (besides submission.sql's, which create runs and deliver answers inside a turn's routing).
--
-- Conventions, checked by tests/test_queue_sql.py:
-- * `-- name: x` starts statement x; `-- fenced` marks a worker write made under a lease. A
--   fenced statement begins by taking the run row with
--       WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
--   in an UPDATE ... RETURNING, and everything else it writes (events, checkpoints, journal
--   rows) selects FROM that CTE, so nothing commits once the run was reclaimed, cancelled or
--   finished: a zero-row result means "fenced: stop, never retry".
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
--   batch (500), so "more" stays a guard rather than the rule under load, where it would wake
--   every stream. Largest payload: about 6.2 kB (12 bytes a name), under the 8,000-byte limit.
--   tests/test_queue_defects.py refuses any aggregate in a notification not bounded this way.
-- * Every multi-row fenced statement takes its run rows in id order (a `locked` CTE, `ORDER BY
--   id FOR UPDATE`) before it updates them: `UPDATE ... FROM unnest(...)` locks rows in the
--   join's order, and two batches of one process in opposite orders deadlocked each other.
-- * Every statement that moves a run between queued, running and anything else keeps its
--   tenant's row in tenant_class_counts in the same statement (the `count_moves` fragment, or
--   the claims' own count-row lock): count rows are locked after the runs, in (tenant_id,
--   band) order (docs/adr/0006). New runs are the exception: `enqueue` and `enqueue_many`
--   add them to the tenant's stripes (tenant_queued_stripes) through turnstile_add_queued,
--   never to its count row, so one tenant's enqueues do not serialise ("Striped queued
--   counts" in docs/adr/0006). A tenant's queued total is its row's `queued` plus its 8
--   stripes; `has_work` says it may have queued runs, and only turnstile_clear_work clears it.


-- fragment: webhook_deliveries
-- Webhooks (issue 24): a statement that makes a transition webhooks report defines
-- `hook_source` (run_id, tenant_id, agent, event, data: one row per transition it made), and
-- this turns each row into one delivery per live endpoint of the run's tenant that takes the
-- event: a queued async-class run of the built-in `webhook` agent, with its run.created event,
-- its input (the body to send) and its link to the endpoint. Being in the transition's own
-- statement, a committed transition always has its deliveries and a fenced write (no row in
-- `run`) never has any. A tenant without endpoints pays one empty probe of the partial index
-- ix_webhook_endpoints_tenant_id. The statement's NOTIFY adds "work": [10] when `hook` has rows.
hook AS MATERIALIZED (
    SELECT gen_random_uuid() AS id, e.id AS endpoint_id, e.principal, s.tenant_id,
           s.run_id AS source_id, s.event,
           s.data, clock.now
    FROM hook_source s
    JOIN webhook_endpoints e
      ON e.tenant_id = s.tenant_id AND e.deleted_at IS NULL AND e.disabled_at IS NULL
     AND (cardinality(e.events) = 0 OR s.event = ANY(e.events))
    CROSS JOIN clock
    -- Deliveries never produce deliveries.
    WHERE s.agent <> 'webhook'
),
hook_body AS MATERIALIZED (
    -- The input carries its webhook-id and endpoint, so a resubmitted dead letter (a new run
    -- with the same input) sends the same delivery again, with the same webhook-id.
    SELECT hook.*, jsonb_build_object(
               'webhook_id', id, 'endpoint_id', endpoint_id,
               'body', jsonb_build_object('type', event, 'timestamp', now, 'data', data)) AS input
    FROM hook
),
hook_run AS (
    -- Its own attempts (:hook_attempts) and, in release_early and sweep_expired, its own
    -- backoff: a receiver may be down for hours, not the seconds an agent run's retries cover.
    INSERT INTO runs (id, tenant_id, principal, status, priority, agent, input, max_attempts,
                      last_event_seq, inputs_count, created_at, updated_at)
    SELECT id, tenant_id, principal, 'queued', 10, 'webhook', input, :hook_attempts, 1, 1,
           now, now
    FROM hook_body
),
hook_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT id, 1, 'run.created', 0,
           jsonb_build_object('priority', 10, 'agent', 'webhook', 'principal', principal,
                              'webhook', jsonb_build_object('endpoint_id', endpoint_id,
                                                            'source_run_id', source_id,
                                                            'event', event)),
           now
    FROM hook
),
hook_input AS (
    INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
    SELECT id, 1, input, principal, 1, now FROM hook_body
),
hook_link AS (
    INSERT INTO webhook_deliveries (run_id, endpoint_id, source_run_id, event, created_at)
    SELECT id, endpoint_id, source_id, event, now FROM hook
)


-- fragment: count_moves
-- Fair shares between tenants (docs/adr/0006): the statement's changes to its tenants' running
-- and queued counts, applied in the same statement, so tenant_class_counts is exact at every
-- commit. The statement defines `moves` (tenant_id, band, d_running, d_queued: one row per run
-- it moved between queued, running and anything else, plus one per webhook delivery it
-- queued). The sums are applied once per row (a statement cannot change a row twice: a run's
-- own move and its deliveries' may fall on one row). The rows are locked after the runs (the
-- statement took those first) and in (tenant_id, band) order, the order every statement takes
-- them in, so two statements never deadlock on them. A row that does not exist yet (a
-- tenant's first run of a class) is inserted; ON CONFLICT adds to one a concurrent first run
-- created meanwhile, with its 8 stripes (a count row never exists without them). A missing row
-- only ever receives increments: a run leaving queued or running was counted, so its row
-- exists. A row that gains queued runs gets has_work (it holds the row's lock, so no clear
-- runs meanwhile); a row that loses some, and whose total then reads 0 in this statement's
-- snapshot, is offered to turnstile_clear_work (`move_clear`, which runs only in a statement
-- whose final SELECT reads it: every one with moves out of queued reads it, claim_fifo,
-- cancel, pause_schedule, delete_schedule and webhook_delete).
move_total AS MATERIALIZED (
    SELECT tenant_id, CAST(band AS smallint) AS band, CAST(sum(d_running) AS integer) AS d_running,
           CAST(sum(d_queued) AS integer) AS d_queued
    FROM moves
    GROUP BY tenant_id, band
    HAVING sum(d_running) <> 0 OR sum(d_queued) <> 0
),
move_lock AS MATERIALIZED (
    -- By key: `tenant_id = ANY(ARRAY(...))` is an index condition on the primary key, so the
    -- rows are found by lookups whatever the number of tenants; with the pair `IN (...)` alone
    -- the planner hash-joined a scan of every tenant's rows (tests/test_count_rows_by_key.py).
    SELECT c.tenant_id, c.band FROM tenant_class_counts c
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM move_total))
      AND (c.tenant_id, c.band) IN (SELECT tenant_id, band FROM move_total)
    ORDER BY c.tenant_id, c.band
    FOR UPDATE
),
move_update AS (
    UPDATE tenant_class_counts c
    SET running = c.running + m.d_running, queued = c.queued + m.d_queued,
        has_work = c.has_work OR m.d_queued > 0
    FROM move_lock l JOIN move_total m ON m.tenant_id = l.tenant_id AND m.band = l.band
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM move_lock))  -- by key, as above
      AND c.tenant_id = l.tenant_id AND c.band = l.band
    RETURNING c.tenant_id, c.band, c.queued, m.d_queued
),
move_insert AS (
    INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued, has_work)
    SELECT m.tenant_id, m.band, m.d_running, m.d_queued, m.d_queued > 0 FROM move_total m
    WHERE NOT EXISTS (SELECT 1 FROM move_lock l WHERE l.tenant_id = m.tenant_id
                                                  AND l.band = m.band)
    ORDER BY m.tenant_id, m.band
    ON CONFLICT (tenant_id, band) DO UPDATE
    SET running = c.running + excluded.running, queued = c.queued + excluded.queued,
        has_work = c.has_work OR excluded.has_work
    RETURNING c.tenant_id
),
move_stripes AS (
    -- After the rows (reading move_insert makes it run first), as turnstile_add_queued
    -- creates them: a concurrent first run then waits on the row, never on a stripe.
    INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
    SELECT m.tenant_id, m.band, g.stripe, 0
    FROM move_total m CROSS JOIN generate_series(0, 7) AS g(stripe)
    CROSS JOIN (SELECT count(*) FROM move_insert) AS rows_first
    WHERE NOT EXISTS (SELECT 1 FROM move_lock l WHERE l.tenant_id = m.tenant_id
                                                  AND l.band = m.band)
    ORDER BY m.tenant_id, m.band, g.stripe
    ON CONFLICT (tenant_id, band, stripe) DO NOTHING
),
move_clear AS (
    -- The snapshot's stripes: an enqueue it does not see only makes the function look (and
    -- find the total above 0); the function decides on the rows it locks.
    SELECT turnstile_clear_work(u.tenant_id, u.band) AS cleared FROM move_update u
    WHERE u.d_queued < 0
      AND u.queued + (SELECT coalesce(sum(s.queued), 0) FROM tenant_queued_stripes s
                      WHERE s.tenant_id = u.tenant_id AND s.band = u.band) <= 0
)


-- fragment: queued_adds
-- New runs (docs/adr/0006, "Striped queued counts"): the statement defines `added`
-- (tenant_id, band smallint, n: its new queued runs), and turnstile_add_queued adds them to
-- this connection's stripe of each (tenant, band), creating the count row and its stripes for
-- a first run, then sets has_work on a snapshot of its own if a clear went before. The count
-- row itself is not written (unless the flag was clear), so one tenant's concurrent enqueues
-- do not wait for each other's commits. Bands in order, so two batches never deadlock on
-- stripes. The final SELECT must read `queued_added` (a SELECT in WITH runs only when read).
queued_added AS (
    SELECT turnstile_add_queued(a.tenant_id, a.band, a.n) AS done
    FROM (SELECT tenant_id, band, sum(n) AS n FROM added
          GROUP BY tenant_id, band ORDER BY tenant_id, band) AS a
)


-- fragment: claim_clear
-- A claim's `counted` returns (tenant_id, band, queued) of the count rows it decremented. A
-- row whose total reads 0 or less in the claim's snapshot (the row's queued as just updated,
-- the stripes as the snapshot has them) is offered to turnstile_clear_work, which decides on
-- the rows it locks; the common case (work left) costs one read of the 8 stripes by key. The
-- final SELECT reads `cleared`, so it runs after `counted` changed the row.
cleared AS (
    SELECT turnstile_clear_work(u.tenant_id, u.band) AS cleared FROM counted u
    WHERE u.queued + (SELECT coalesce(sum(s.queued), 0) FROM tenant_queued_stripes s
                      WHERE s.tenant_id = u.tenant_id AND s.band = u.band) <= 0
)


-- fragment: fair_walk
-- The fair order (docs/adr/0006), shared by claim_one and claim_many as a FROM item: for each
-- class band of :priorities, highest class first, the band's count rows with queued runs in
-- (running, last_claimed_at NULLS FIRST, tenant_id) order (has_work: may have queued runs; a
-- tenant with none costs a probe until its flag is cleared), read in that order from
-- ix_tenant_class_counts_fair, each with the tenant's concurrency limit for the band: its
-- tenant_limits entry, read at every claim so an admin's change applies to the next one, else
-- the process default :max_running (by band; NULL for none). Names `b.band`, `t.tenant_id`,
-- `t.running`, `t.last_claimed_at` and `cap.cap`.
(SELECT DISTINCT p / 10 AS band FROM unnest(CAST(:priorities AS smallint[])) AS p
 ORDER BY 1) AS b
CROSS JOIN LATERAL (
    SELECT c.tenant_id, c.running, c.last_claimed_at FROM tenant_class_counts c
    WHERE c.band = b.band AND c.has_work
    ORDER BY c.running, c.last_claimed_at NULLS FIRST, c.tenant_id
    -- No limit in effect, but not a constant: the planner then plans the walk for its first
    -- rows and reads ix_tenant_class_counts_fair in order, instead of sorting every count row
    -- of the class for a walk the outer LIMIT stops after a few.
    LIMIT (SELECT 2147483647)
) AS t
CROSS JOIN LATERAL (
    SELECT coalesce(
        (SELECT CAST(l.max_running
                     ->> (ARRAY['interactive', 'async', 'maintenance'])[b.band + 1] AS integer)
         FROM tenant_limits l WHERE l.tenant_id = t.tenant_id),
        (CAST(:max_running AS integer[]))[b.band + 1]) AS cap
) AS cap


-- fragment: queued_quota
-- The tenant's queued quota for a new run (docs/adr/0006), shared by `enqueue` and
-- `enqueue_many`: `quota` (max_queued: its tenant_limits override, else :max_queued, the
-- process default, NULL for none; queued: its total, the count rows plus their stripes, read
-- only when there is a quota to hold it against).
quota AS MATERIALIZED (
    -- The total is read only when there is a quota to hold it against.
    SELECT l.max_queued,
           CASE WHEN l.max_queued IS NOT NULL THEN
               (SELECT coalesce(sum(c.queued), 0) FROM tenant_class_counts c
                WHERE c.tenant_id = :tenant_id)
               + (SELECT coalesce(sum(s.queued), 0) FROM tenant_queued_stripes s
                  WHERE s.tenant_id = :tenant_id)
           END AS queued
    FROM (SELECT coalesce((SELECT l.max_queued FROM tenant_limits l
                           WHERE l.tenant_id = :tenant_id),
                          CAST(:max_queued AS integer)) AS max_queued) AS l
)


-- name: enqueue
-- A new queued run, its run.created event and its first input, in one statement.
-- A run of a session gets the next run number of its session. The caller holds the session
-- row lock (a resubmission takes lock_session first; a turn goes through turnstile_submit,
-- which numbers its run the same way under the same lock), so no other run of the session is
-- being created meanwhile; uq_runs_session_id_session_run_no is the backstop.
-- The number is read from the session's runs, not from a counter on the session row: no write
-- but a submission's ever needs that row.
-- The tenant's queued quota (docs/adr/0006): its override in tenant_limits, else :max_queued
-- (the process default, NULL for none). A tenant at its quota gets no row: the caller raises
-- QueueQuotaError. The total is read from the tenant's count rows (one per class) and their
-- stripes, not counted.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
{{queued_quota}},
run AS (
    INSERT INTO runs (id, tenant_id, principal, session_id, session_run_no, status, priority,
                      agent, input, max_attempts, scheduled_for, last_event_seq, inputs_count,
                      resubmitted_from, traceparent, created_at, updated_at)
    SELECT :id, :tenant_id, :principal, :session_id,
           CASE WHEN CAST(:session_id AS uuid) IS NOT NULL THEN
               (SELECT coalesce(max(n.session_run_no), 0) + 1 FROM runs n
                WHERE n.session_id = CAST(:session_id AS uuid))
           END,
           'queued', :priority, :agent,
           CAST(:input AS jsonb), :max_attempts, :scheduled_for, 1, 1,
           :resubmitted_from, :traceparent, clock.now, clock.now
    FROM clock, quota
    -- A resubmitted webhook delivery is exempt, as deliveries are (docs/adr/0006).
    WHERE quota.max_queued IS NULL OR quota.queued < quota.max_queued
       OR CAST(:agent AS text) = 'webhook'
    RETURNING *
),
added AS (
    SELECT tenant_id, CAST(priority / 10 AS smallint) AS band, 1 AS n FROM run
),
{{queued_adds}},
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT id, 1, 'run.created', 0,
           jsonb_build_object('priority', priority, 'agent', agent, 'principal', principal,
                              'scheduled_for', scheduled_for,
                              'resubmitted_from', resubmitted_from,
                              -- the key that submitted it (an operator's, on a user's session)
                              'by', CAST(:actor AS text)),
           created_at
    FROM run
),
first_input AS (
    INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
    SELECT id, 1, input, principal, 1, created_at FROM run
)
SELECT run.*,
       -- A run of a session names the session too: its streams, in whichever API process,
       -- look again now (migration 0013 does the same in turnstile_submit).
       pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
           'work', jsonb_build_array(priority),
           'sessions', CASE WHEN session_id IS NOT NULL
                            THEN jsonb_build_array(left(session_id::text, 8)) END))::text)
FROM run CROSS JOIN (SELECT count(*) FROM queued_added) AS counted;


-- name: enqueue_many
-- Bulk enqueue of sessionless runs (back-end batches, benchmarks): one statement, one NOTIFY.
-- The tenant's queued quota as in `enqueue`: a batch that would take the tenant past it is
-- refused whole (nothing enqueued: the caller raises QueueQuotaError).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
{{queued_quota}},
spec AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:priorities AS smallint[]),
                         CAST(:agents AS text[]), CAST(:inputs AS jsonb[]),
                         CAST(:scheduled AS timestamptz[]))
        AS s(id, priority, agent, input, scheduled_for)
),
run AS (
    INSERT INTO runs (id, tenant_id, principal, status, priority, agent, input, max_attempts,
                      scheduled_for, last_event_seq, inputs_count, created_at, updated_at)
    SELECT spec.id, :tenant_id, :principal, 'queued', spec.priority, spec.agent, spec.input,
           :max_attempts, spec.scheduled_for, 1, 1, clock.now, clock.now
    FROM spec, clock, quota
    WHERE quota.max_queued IS NULL
       OR quota.queued + cardinality(CAST(:ids AS uuid[])) <= quota.max_queued
    RETURNING id, tenant_id, priority, agent, input, principal, scheduled_for, created_at
),
added AS (
    SELECT tenant_id, CAST(priority / 10 AS smallint) AS band, 1 AS n FROM run
),
{{queued_adds}},
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT id, 1, 'run.created', 0,
           jsonb_build_object('priority', priority, 'agent', agent, 'principal', principal,
                              'scheduled_for', scheduled_for),
           created_at
    FROM run
),
first_input AS (
    INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
    SELECT id, 1, input, principal, 1, created_at FROM run
)
SELECT count(*) AS enqueued,
       pg_notify('turnstile', jsonb_build_object(
           'work', (SELECT jsonb_agg(DISTINCT priority) FROM run))::text) AS notified
FROM run CROSS JOIN (SELECT count(*) FROM queued_added) AS counted;


-- name: tenant_quota
-- A tenant's queued quota (its override, else the process default :max_queued) and its
-- queued total, for the message of a refusal (QueueQuotaError).
SELECT coalesce((SELECT l.max_queued FROM tenant_limits l WHERE l.tenant_id = :tenant_id),
                CAST(:max_queued AS integer)) AS max_queued,
       (SELECT coalesce(sum(c.queued), 0) FROM tenant_class_counts c
        WHERE c.tenant_id = :tenant_id)
       + (SELECT coalesce(sum(s.queued), 0) FROM tenant_queued_stripes s
          WHERE s.tenant_id = :tenant_id) AS queued;

-- name: claim_one
-- ADR-0004 decision 1, with fair shares between tenants (docs/adr/0006): the highest-priority
-- class with work to claim now; within it, the tenant with the fewest running runs of the
-- class (its count row, not a count of the running set), ties to the least recently served;
-- within the tenant, its highest-priority, longest-eligible queued run. Priorities inside a
-- class band order runs only within a tenant.
-- The walk reads tenant_class_counts' rows with queued runs in that order
-- (ix_tenant_class_counts_fair) and, for each, probes the head of the tenant's queue at each
-- priority of the band (ix_runs_tenant_claim: one bounded range per priority, no walk over
-- backed-off runs), stopping at the first run it can lock: its cost depends on neither the
-- depth of the queue nor the number of tenants holding work, only on the tenants it passes
-- (ones at their limit, or whose queued runs are all scheduled later). The nested loops keep
-- the walk's order, and LIMIT 1 stops them at the first run: no Sort, which would evaluate
-- (and lock) every tenant's head. SKIP LOCKED as before: claimers contending for one busy
-- tenant take its next runs instead of queueing on one row lock.
-- The tenant's concurrency limit for the class: its tenant_limits row (read now, so an
-- admin's change applies to the next claim) over :max_running (the process default per band,
-- NULL for none). A tenant at its limit is passed over, so its runs never block another
-- tenant's behind them; only its webhook deliveries and schedule ticks, exempt from limits
-- (`is_hook`), are probed (ix_runs_tenant_exempt). The walk reads the counts of its snapshot; the limit is then
-- checked exactly against the chosen tenant's count row locked FOR UPDATE (after the run, in
-- (tenant_id, band) order like every statement; the lock waits for a concurrent claim of the
-- tenant and returns its row as that claim left it).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
picked AS MATERIALIZED (
    SELECT head.id, head.is_hook, t.tenant_id, b.band, cap.cap
    FROM {{fair_walk}}
    CROSS JOIN LATERAL (
        SELECT h.id, h.is_hook FROM unnest(CAST(:priorities AS smallint[])) AS p(priority)
        CROSS JOIN LATERAL (
            -- Under its limit: the tenant's head (webhook deliveries included). At it: its
            -- deliveries only. Each leg is a subquery, as a UNION's own legs may not lock.
            SELECT * FROM (
                SELECT q.id, (q.agent = 'webhook' OR q.schedule_id IS NOT NULL) AS is_hook FROM runs q
                WHERE (cap.cap IS NULL OR t.running < cap.cap)
                  AND q.tenant_id = t.tenant_id AND q.status = 'queued'
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)
                LIMIT 1
                FOR UPDATE SKIP LOCKED) AS open_head
            UNION ALL
            SELECT * FROM (
                SELECT q.id, true FROM runs q
                WHERE cap.cap IS NOT NULL AND t.running >= cap.cap
                  AND q.tenant_id = t.tenant_id AND q.status = 'queued'
                  AND (q.agent = 'webhook' OR q.schedule_id IS NOT NULL)
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)
                LIMIT 1
                FOR UPDATE SKIP LOCKED) AS delivery_head
        ) AS h
        WHERE p.priority / 10 = b.band
        LIMIT 1
    ) AS head
    LIMIT 1
),
allowed AS (
    -- Only a tenant under a limit needs its count row's latest value before the claim: the
    -- row is then locked here (a subquery OR evaluates only when the limit applies); without
    -- a limit, `counted` below locks it by updating it. One row either way, after the run.
    SELECT picked.id FROM picked
    WHERE picked.is_hook OR picked.cap IS NULL
       OR picked.cap > (SELECT c.running FROM tenant_class_counts c
                        WHERE c.tenant_id = picked.tenant_id AND c.band = picked.band
                        FOR UPDATE)
),
claimed AS (
    UPDATE runs r
    SET status = 'running',
        lease_epoch = r.lease_epoch + 1,        -- the fencing token of this claim
        attempts = r.attempts + 1,
        lease_owner = :owner,
        lease_expires_at = clock.now + make_interval(secs => :lease_seconds),
        last_event_seq = r.last_event_seq + 1,
        started_at = coalesce(r.started_at, clock.now),
        updated_at = clock.now
    FROM clock
    -- By primary key alone. The run is locked (picked, FOR UPDATE SKIP LOCKED, which
    -- rechecked it queued), so it is still queued; a `status = 'queued'` here let a plan made
    -- on an empty table reach it through the queued runs' partial index, filtering the
    -- tenant's whole queue by id once it grew (tests/test_claim_plans.py).
    WHERE r.id = (SELECT id FROM allowed)
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
counted AS (
    -- The row `allowed` locked, or this locks it. last_claimed_at orders ties between
    -- tenants: it is the database's wall clock (clock_timestamp()), a serving order rather
    -- than a run's time, so it advances even when a test holds the clock still.
    UPDATE tenant_class_counts c
    SET running = c.running + 1, queued = c.queued - 1, last_claimed_at = clock_timestamp()
    FROM claimed
    WHERE c.tenant_id = claimed.tenant_id AND c.band = claimed.priority / 10
    RETURNING c.tenant_id, c.band, c.queued
),
{{claim_clear}}
-- A row even when nothing was claimed (its id NULL): `passed_over` counts the runs this claim
-- locked but left queued because their tenant's locked count row showed it at its limit (a
-- concurrent claim took the room first). The caller then asks again at once (Queue.claim):
-- another tenant's run may be waiting.
SELECT claimed.*,
       (SELECT count(*) FROM picked) - (SELECT count(*) FROM claimed) AS passed_over
FROM (SELECT 1) AS one LEFT JOIN claimed ON true
CROSS JOIN (SELECT count(*) FROM cleared) AS cleared;


-- name: claim_many
-- The batch form of claim_one (same order, limits and locks): up to :limit runs in one
-- statement, each with its own new epoch. A batch of k takes from the first k tenants in the
-- fair order that have a run to claim now (`walk`: one probe each, no lock), at most
-- ceil(k / n) runs from each of those n tenants of a class (`picked`, SKIP LOCKED), and then
-- the highest class first and, within it, round robin over its tenants: every tenant's first
-- run, then every tenant's second, ... So a batch returns
-- fewer than k when the n tenants hold fewer than that share; the claim loop asks again at once
-- when a claim returned anything but less than it asked for (app/worker/pool.py), and the next
-- batch starts again from the tenants with the fewest running. The ids are collected with
-- id = ANY(ARRAY(...)) rather than IN (SELECT ... LIMIT), which the planner may re-run and so
-- lock and claim more rows than the limit. Limits are checked exactly as in claim_one, each
-- tenant's chosen runs ranked against the room left under its locked count row.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
walk AS MATERIALIZED (
    SELECT b.band, t.tenant_id, t.running, t.last_claimed_at, cap.cap,
           coalesce(t.running >= cap.cap, false) AS full
    FROM {{fair_walk}}
    CROSS JOIN LATERAL (
        -- Whether the tenant has a run to claim now: a probe per priority of the band, each
        -- a LIMIT 1 subquery (an EXISTS would let the planner hash one scan of every queued
        -- run instead), stopping at the first found.
        SELECT 1 FROM unnest(CAST(:priorities AS smallint[])) AS p(priority)
        CROSS JOIN LATERAL (
            SELECT * FROM (
                SELECT 1 FROM runs q
                WHERE NOT coalesce(t.running >= cap.cap, false)
                  AND q.tenant_id = t.tenant_id AND q.status = 'queued'
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)  -- the index's order
                LIMIT 1) AS open_run
            UNION ALL
            SELECT * FROM (
                SELECT 1 FROM runs q
                WHERE coalesce(t.running >= cap.cap, false)
                  AND q.tenant_id = t.tenant_id AND q.status = 'queued'
                  AND (q.agent = 'webhook' OR q.schedule_id IS NOT NULL)
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)  -- the index's order
                LIMIT 1) AS delivery
        ) AS found
        WHERE p.priority / 10 = b.band
        LIMIT 1
    ) AS probe
    LIMIT :limit
),
turn AS MATERIALIZED (
    SELECT walk.*,
           row_number() OVER (ORDER BY band, running, last_claimed_at NULLS FIRST,
                                       tenant_id) AS turn,
           -- n: the tenants of its class in the walk (classes never share a batch's turns)
           CAST(ceil(CAST(:limit AS numeric) / count(*) OVER (PARTITION BY band)) AS integer)
               AS share
    FROM walk
),
picked AS MATERIALIZED (
    SELECT head.id, head.is_hook, head.priority, head.at, turn.tenant_id, turn.band,
           turn.cap, turn.turn,
           row_number() OVER (PARTITION BY turn.tenant_id, turn.band
                              ORDER BY head.priority, head.at) AS nth
    FROM turn
    CROSS JOIN LATERAL (
        SELECT h.id, h.is_hook, p.priority, h.at
        FROM unnest(CAST(:priorities AS smallint[])) AS p(priority)
        CROSS JOIN LATERAL (
            -- As in claim_one: the tenant's runs under its limit, its deliveries at it.
            SELECT * FROM (
                SELECT q.id, (q.agent = 'webhook' OR q.schedule_id IS NOT NULL) AS is_hook,
                       coalesce(q.scheduled_for, q.created_at) AS at
                FROM runs q
                WHERE NOT turn.full
                  AND q.tenant_id = turn.tenant_id AND q.status = 'queued'
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)
                LIMIT turn.share
                FOR UPDATE SKIP LOCKED) AS open_runs
            UNION ALL
            SELECT * FROM (
                SELECT q.id, true, coalesce(q.scheduled_for, q.created_at)
                FROM runs q
                WHERE turn.full
                  AND q.tenant_id = turn.tenant_id AND q.status = 'queued'
                  AND (q.agent = 'webhook' OR q.schedule_id IS NOT NULL)
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
                ORDER BY coalesce(q.scheduled_for, q.created_at)
                LIMIT turn.share
                FOR UPDATE SKIP LOCKED) AS deliveries
        ) AS h
        WHERE p.priority / 10 = turn.band
        LIMIT turn.share
    ) AS head
),
batch AS MATERIALIZED (
    -- The highest class first; within it round robin: each tenant's first run, then each
    -- one's second, ...
    SELECT picked.*,
           row_number() OVER (PARTITION BY tenant_id, band, is_hook ORDER BY nth) AS rank
    FROM (SELECT * FROM picked ORDER BY band, nth, turn LIMIT :limit) AS picked
),
counts AS MATERIALIZED (
    -- By key, as in count_moves.
    SELECT c.tenant_id, c.band, c.running FROM tenant_class_counts c
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM batch))
      AND (c.tenant_id, c.band) IN (SELECT tenant_id, band FROM batch)
    ORDER BY c.tenant_id, c.band
    FOR UPDATE
),
allowed AS (
    SELECT batch.id FROM batch
    JOIN counts ON counts.tenant_id = batch.tenant_id AND counts.band = batch.band
    WHERE batch.is_hook OR batch.cap IS NULL OR counts.running + batch.rank <= batch.cap
),
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
    -- By primary key alone: locked and still queued, as in claim_one.
    WHERE r.id = ANY(ARRAY(SELECT id FROM allowed))
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
counted AS (
    -- The rows `counts` locked (see claim_one).
    UPDATE tenant_class_counts c
    SET running = c.running + n.n, queued = c.queued - n.n, last_claimed_at = clock_timestamp()
    FROM (SELECT tenant_id, priority / 10 AS band, count(*) AS n FROM claimed
          GROUP BY tenant_id, priority / 10) AS n
    WHERE c.tenant_id = ANY(ARRAY(SELECT tenant_id FROM counts))  -- by key, as in count_moves
      AND c.tenant_id = n.tenant_id AND c.band = n.band
    RETURNING c.tenant_id, c.band, c.queued
),
{{claim_clear}}
-- No ORDER BY: the rows come back in no set order and the caller sorts the batch, which
-- keeps a Sort node out of the plan. A row even when nothing was claimed, with `passed_over`,
-- as in claim_one.
SELECT claimed.*,
       (SELECT count(*) FROM batch) - (SELECT count(*) FROM claimed) AS passed_over
FROM (SELECT 1) AS one LEFT JOIN claimed ON true
CROSS JOIN (SELECT count(*) FROM cleared) AS cleared;


-- name: claim_fifo
-- The claim without fair shares (QueueConfig.fair_claim off, a test-only switch: it exists so
-- the noisy-neighbour test can show what the fair order changes): up to :limit runs by
-- priority then eligibility time across every tenant, as before issue 21, tenants' limits not
-- applied. The counts are still kept.
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
    SELECT tenant_id, priority / 10 AS band, 1 AS d_running, -1 AS d_queued FROM claimed
),
{{count_moves}}
SELECT claimed.* FROM claimed CROSS JOIN (SELECT count(*) FROM move_clear) AS cleared;


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


-- name: wait_for_user
-- fenced
-- A question is not a failure: the lease is given up, attempts restart from 0, and the run keeps
-- its session's one active slot while it waits (the answer resumes this same run).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs r
    SET status = 'waiting_for_user',
        question = CAST(:question AS jsonb),
        attempts = 0,
        lease_owner = NULL,
        lease_expires_at = NULL,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM clock
    WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status = 'running'
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.question, r.tenant_id, r.agent,
              r.session_id, r.priority
),
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.waiting' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id,
                              'status', 'waiting_for_user', 'question', question) AS data
    FROM run
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running, 0 AS d_queued FROM run
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}},
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.waiting', run.lease_epoch,
           jsonb_build_object('question', run.question, 'step', CAST(:step AS integer)), clock.now
    FROM run, clock
),
checkpoint AS (
    INSERT INTO checkpoints (run_id, event_seq, epoch, step, state, created_at)
    SELECT run.id, run.last_event_seq, run.lease_epoch, :step, CAST(:state AS jsonb), clock.now
    FROM run, clock
)
SELECT run.last_event_seq AS seq,
       pg_notify('turnstile', (jsonb_build_object(
           'runs', jsonb_build_array(left(run.id::text, 8)))
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text)
FROM run;


-- name: complete
-- fenced
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs r
    SET status = 'succeeded',
        result = CAST(:result AS jsonb),
        lease_owner = NULL,
        lease_expires_at = NULL,
        finished_at = clock.now,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM clock
    WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status = 'running'
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.priority, r.tenant_id, r.agent,
              r.session_id
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.succeeded', run.lease_epoch,
           jsonb_build_object('result', CAST(:result AS jsonb)), clock.now
    FROM run, clock
),
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.succeeded' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'succeeded',
                              'result', CAST(:result AS jsonb)) AS data
    FROM run
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running, 0 AS d_queued FROM run
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}}
SELECT run.last_event_seq AS seq, run.priority,
       pg_notify('turnstile', (jsonb_build_object(
           'runs', jsonb_build_array(left(run.id::text, 8)))
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text)
FROM run;


-- name: complete_many
-- fenced
-- Group commit of completions: the runs a slot group finished while the previous batch was
-- committing, in one statement and one transaction (one commit, one WAL flush, one NOTIFY)
-- instead of one each. Every run is fenced on its own (run id, epoch) pair, exactly as
-- `complete` fences one: a run whose fence does not match (reclaimed, cancelled, finished) is
-- not updated, so it produces no row in `run` and therefore no event; it is simply missing
-- from the result, and its caller gets Fenced. The batch shares the statement, nothing else.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
held AS (
    SELECT * FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]),
                         CAST(:results AS jsonb[])) AS h(run_id, epoch, result)
),
locked AS MATERIALIZED (
    -- Rows in id order first, as heartbeat_many takes them (see the header); only rows still
    -- held under the given epochs.
    SELECT r.id FROM runs r
    JOIN held ON r.id = held.run_id AND r.lease_epoch = held.epoch AND r.status = 'running'
    ORDER BY r.id
    FOR UPDATE OF r
),
run AS (
    UPDATE runs r
    SET status = 'succeeded',
        result = held.result,
        lease_owner = NULL,
        lease_expires_at = NULL,
        finished_at = clock.now,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM held, locked, clock
    WHERE r.id = locked.id
      AND r.id = held.run_id AND r.lease_epoch = held.epoch AND r.status = 'running'
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.priority, r.result, r.tenant_id,
              r.agent, r.session_id
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.succeeded', run.lease_epoch,
           jsonb_build_object('result', run.result), clock.now
    FROM run, clock
),
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.succeeded' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'succeeded',
                              'result', result) AS data
    FROM run
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running, 0 AS d_queued FROM run
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}}
-- One row whatever the batch: the written runs as parallel arrays ((id, epoch) names a write:
-- one process may hold a stale and a fresh execution of one run), and one bounded NOTIFY (none
-- when nothing was written).
SELECT coalesce(array_agg(run.id), '{}') AS ids,
       coalesce(array_agg(run.lease_epoch), '{}') AS epochs,
       coalesce(array_agg(run.last_event_seq), '{}') AS seqs,
       coalesce(array_agg(run.priority), '{}') AS priorities,
       CASE WHEN count(*) > 0 THEN pg_notify('turnstile', (jsonb_build_object(
           'runs', (SELECT jsonb_agg(left(named.id::text, 8))
                    FROM (SELECT id FROM run LIMIT 500) AS named),
           'more', count(*) > 500)
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text) END AS notified
FROM run;

-- name: fail
-- fenced
-- A permanent failure (ADR-0004 decision 5): failed at once, never requeued, whatever the
-- attempts left. runs.failure is the dead letter. Unsafe calls the run left open (a time limit
-- reached inside one) are recorded 'uncertain' first and named in the failure, as when the
-- sweeper dead-letters a run (see sweep_expired).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
open_calls AS MATERIALIZED (
    SELECT j.step, j.tool, j.idempotency_class, j.idempotency_key,
           row_number() OVER (ORDER BY j.event_seq) AS n
    FROM tool_journal j
    WHERE j.run_id = :run_id AND j.entry = 'started' AND j.idempotency_class = 'unsafe'
      AND NOT EXISTS (SELECT 1 FROM tool_journal later
                      WHERE later.run_id = j.run_id AND later.step = j.step
                        AND later.event_seq > j.event_seq)
),
open_summary AS (
    SELECT count(*) AS calls,
           jsonb_agg(jsonb_build_object('step', step, 'tool', tool) ORDER BY n) AS described,
           string_agg(format('%s (step %s)', tool, step), ', ' ORDER BY n) AS named
    FROM open_calls
),
run AS (
    UPDATE runs r
    SET status = 'failed',
        failure = CASE WHEN open_summary.calls = 0 THEN CAST(:failure AS jsonb)
                       ELSE CAST(:failure AS jsonb) || jsonb_build_object(
                           'message', coalesce(CAST(:failure AS jsonb) ->> 'message', '')
                                      || '; outcome unknown of ' || open_summary.named,
                           'uncertain_calls', open_summary.described) END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        finished_at = clock.now,
        -- One event per uncertain call, then the run's own.
        last_event_seq = r.last_event_seq + 1 + open_summary.calls,
        updated_at = clock.now
    FROM clock, open_summary
    WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status = 'running'
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.failure, r.priority,
              open_summary.calls AS open_calls, r.tenant_id, r.agent, r.session_id
),
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.failed' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'failed',
                              'failure', failure) AS data
    FROM run
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running, 0 AS d_queued FROM run
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}},
uncertain_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + open_calls.n, 'tool.finished',
           run.lease_epoch,
           jsonb_build_object('step', open_calls.step, 'tool', open_calls.tool,
                              'idempotency_class', open_calls.idempotency_class,
                              'outcome_status', 'uncertain',
                              'outcome', jsonb_build_object('message', CAST(:unknown AS text))),
           clock.now
    FROM run, open_calls, clock
),
uncertain_journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + open_calls.n, run.lease_epoch,
           open_calls.step, 'finished', open_calls.tool, open_calls.idempotency_class,
           open_calls.idempotency_key, 'uncertain',
           jsonb_build_object('message', CAST(:unknown AS text)), clock.now
    FROM run, open_calls, clock
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.failed', run.lease_epoch,
           jsonb_build_object('failure', run.failure), clock.now
    FROM run, clock
)
SELECT run.last_event_seq AS seq, run.priority,
       pg_notify('turnstile', (jsonb_build_object(
           'runs', jsonb_build_array(left(run.id::text, 8)))
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text)
FROM run;


-- name: release_graceful
-- fenced
-- A draining worker hands the run back: requeued at once, and the claim is given back
-- (attempts - 1), since the run did nothing wrong.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs r
    SET status = 'queued',
        attempts = greatest(r.attempts - 1, 0),
        lease_owner = NULL,
        lease_expires_at = NULL,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM clock
    WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status = 'running'
    RETURNING r.id, r.last_event_seq, r.lease_epoch, r.priority, r.attempts, r.tenant_id
),
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running, 1 AS d_queued FROM run
),
{{count_moves}},
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.released', run.lease_epoch,
           jsonb_build_object('graceful', true, 'attempts', run.attempts,
                              'reason', CAST(:reason AS text)), clock.now
    FROM run, clock
)
SELECT run.last_event_seq AS seq, run.priority,
       pg_notify('turnstile', jsonb_build_object('work', jsonb_build_array(run.priority))::text)
FROM run;


-- name: release_early
-- fenced
-- Transient retries inside the run ran out: counted like a lost lease. Requeued with backoff,
-- or failed when this was the last attempt. Only this statement and the sweeper compare
-- attempts with max_attempts. Dead-lettering, it records the unsafe calls the run left open
-- as 'uncertain' first, as the sweeper does (see sweep_expired); requeued, it leaves them to
-- the next attempt's recovery.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
open_calls AS MATERIALIZED (
    SELECT j.step, j.tool, j.idempotency_class, j.idempotency_key,
           row_number() OVER (ORDER BY j.event_seq) AS n
    FROM tool_journal j
    WHERE j.run_id = :run_id AND j.entry = 'started' AND j.idempotency_class = 'unsafe'
      AND NOT EXISTS (SELECT 1 FROM tool_journal later
                      WHERE later.run_id = j.run_id AND later.step = j.step
                        AND later.event_seq > j.event_seq)
),
open_summary AS (
    SELECT count(*) AS calls,
           jsonb_agg(jsonb_build_object('step', step, 'tool', tool) ORDER BY n) AS described,
           string_agg(format('%s (step %s)', tool, step), ', ' ORDER BY n) AS named
    FROM open_calls
),
run AS (
    UPDATE runs r
    SET status = CASE WHEN r.attempts >= r.max_attempts THEN 'failed' ELSE 'queued' END,
        failure = CASE WHEN r.attempts >= r.max_attempts THEN jsonb_strip_nulls(jsonb_build_object(
                      'kind', 'attempts_exhausted',
                      'message', format('transient errors on attempt %s of %s: %s',
                                        r.attempts, r.max_attempts, CAST(:reason AS text))
                                 || coalesce('; outcome unknown of ' || open_summary.named, ''),
                      'attempts', r.attempts,
                      'uncertain_calls', open_summary.described)) END,
        finished_at = CASE WHEN r.attempts >= r.max_attempts THEN clock.now END,
        scheduled_for = CASE WHEN r.attempts >= r.max_attempts THEN r.scheduled_for
                             ELSE clock.now + make_interval(secs => CASE
                                 -- A webhook delivery has its own backoff (see hook_run).
                                 WHEN r.agent = 'webhook' THEN least(
                                     CAST(:hook_backoff_max AS double precision),
                                     :hook_backoff_base * power(2, r.attempts - 1))
                                 ELSE least(:backoff_max, :backoff_base * power(2, r.attempts - 1))
                             END)
                        END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        -- Dead-lettering: one event per uncertain call, then the run's own.
        last_event_seq = r.last_event_seq + 1
            + CASE WHEN r.attempts >= r.max_attempts THEN open_summary.calls ELSE 0 END,
        updated_at = clock.now
    FROM clock, open_summary
    WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status = 'running'
    RETURNING r.id, r.status, r.last_event_seq, r.lease_epoch, r.priority, r.attempts,
              r.scheduled_for, r.failure,
              CASE WHEN r.status = 'failed' THEN open_summary.calls ELSE 0 END AS open_calls,
              r.tenant_id, r.agent, r.session_id
),
hook_source AS (
    -- Only the last attempt's failure is reported; a requeue is not a transition webhooks see.
    SELECT id AS run_id, tenant_id, agent, 'run.failed' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'failed',
                              'failure', failure) AS data
    FROM run WHERE status = 'failed'
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running,
           CASE WHEN status = 'queued' THEN 1 ELSE 0 END AS d_queued
    FROM run
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}},
uncertain_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + open_calls.n, 'tool.finished',
           run.lease_epoch,
           jsonb_build_object('step', open_calls.step, 'tool', open_calls.tool,
                              'idempotency_class', open_calls.idempotency_class,
                              'outcome_status', 'uncertain',
                              'outcome', jsonb_build_object('message', CAST(:unknown AS text))),
           clock.now
    FROM run JOIN open_calls ON run.status = 'failed', clock
),
uncertain_journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT run.id, run.last_event_seq - run.open_calls - 1 + open_calls.n, run.lease_epoch,
           open_calls.step, 'finished', open_calls.tool, open_calls.idempotency_class,
           open_calls.idempotency_key, 'uncertain',
           jsonb_build_object('message', CAST(:unknown AS text)), clock.now
    FROM run JOIN open_calls ON run.status = 'failed', clock
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq,
           CASE run.status WHEN 'failed' THEN 'run.failed' ELSE 'run.released' END,
           run.lease_epoch,
           CASE run.status
               WHEN 'failed' THEN jsonb_build_object('failure', run.failure)
               ELSE jsonb_build_object('graceful', false, 'attempts', run.attempts,
                                       'retry_at', run.scheduled_for, 'reason', CAST(:reason AS text))
           END,
           clock.now
    FROM run, clock
)
SELECT run.last_event_seq AS seq, run.status, run.priority,
       pg_notify('turnstile', (CASE run.status
           WHEN 'failed' THEN jsonb_build_object('runs', jsonb_build_array(left(run.id::text, 8)))
           ELSE jsonb_build_object('work', jsonb_build_array(run.priority)) END
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text)
FROM run;


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
-- deadline first, locked for this transaction. SKIP LOCKED lets two sweepers, or a sweeper and
-- a worker writing its last heartbeat, pass each other.
SELECT id FROM runs
WHERE status = 'running' AND lease_expires_at < {{now}}
ORDER BY lease_expires_at
LIMIT :limit
FOR UPDATE SKIP LOCKED;


-- name: sweep_expired
-- The sweeper: running runs whose lease deadline passed are requeued with exponential backoff
-- in scheduled_for, or failed once attempts reached max_attempts (the dead letter). The epoch
-- is not bumped here: the status change alone fences the old holder (its fence requires
-- 'running'), and the next claim bumps the epoch.
-- A run dead-lettered in the middle of an unsafe tool call (journal 'started' with no later
-- entry for its step) gets, before its run.failed, a journal outcome 'uncertain' with its own
-- tool.finished event for each such call, and its failure names them: nobody will recover it,
-- so this is the last chance to say that its effect is unknown.
-- It runs in the transaction of lock_expired, after it: the runs are already locked, so no
-- worker can commit a write for them any more, and this statement's fresh snapshot sees every
-- journal entry committed before the lock (one statement would read the journal as of its
-- start, and could call a call that finished meanwhile open).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
expired AS MATERIALIZED (
    -- lock_expired's rows, still checked here: called with any other ids, this statement
    -- must not requeue a live lease.
    SELECT id, attempts >= max_attempts AS last_attempt FROM runs
    WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'running' AND lease_expires_at < {{now}}
),
open_calls AS MATERIALIZED (
    SELECT j.run_id, j.step, j.tool, j.idempotency_class, j.idempotency_key,
           row_number() OVER (PARTITION BY j.run_id ORDER BY j.event_seq) AS n
    FROM expired
    JOIN tool_journal j ON j.run_id = expired.id
    WHERE expired.last_attempt AND j.entry = 'started' AND j.idempotency_class = 'unsafe'
      AND NOT EXISTS (SELECT 1 FROM tool_journal later
                      WHERE later.run_id = j.run_id AND later.step = j.step
                        AND later.event_seq > j.event_seq)
),
open_per_run AS (
    SELECT run_id, count(*) AS calls,
           jsonb_agg(jsonb_build_object('step', step, 'tool', tool) ORDER BY n) AS described,
           string_agg(format('%s (step %s)', tool, step), ', ' ORDER BY n) AS named
    FROM open_calls
    GROUP BY run_id
),
swept AS (
    UPDATE runs r
    SET status = CASE WHEN expired.last_attempt THEN 'failed' ELSE 'queued' END,
        failure = CASE WHEN expired.last_attempt THEN jsonb_strip_nulls(jsonb_build_object(
                      'kind', 'lease_expired',
                      'message', format('lease expired on attempt %s of %s (last owner %s)',
                                        r.attempts, r.max_attempts, r.lease_owner)
                                 || coalesce('; outcome unknown of ' || open_per_run.named, ''),
                      'attempts', r.attempts,
                      'uncertain_calls', open_per_run.described)) END,
        finished_at = CASE WHEN expired.last_attempt THEN clock.now END,
        scheduled_for = CASE WHEN expired.last_attempt THEN r.scheduled_for
                             ELSE clock.now + make_interval(secs => CASE
                                 -- A webhook delivery has its own backoff (see hook_run).
                                 WHEN r.agent = 'webhook' THEN least(
                                     CAST(:hook_backoff_max AS double precision),
                                     :hook_backoff_base * power(2, r.attempts - 1))
                                 ELSE least(:backoff_max, :backoff_base * power(2, r.attempts - 1))
                             END)
                        END,
        lease_owner = NULL,
        lease_expires_at = NULL,
        -- One event per uncertain call, then the run's own.
        last_event_seq = r.last_event_seq + 1 + coalesce(open_per_run.calls, 0),
        updated_at = clock.now
    FROM expired LEFT JOIN open_per_run ON open_per_run.run_id = expired.id, clock
    WHERE r.id = expired.id
    RETURNING r.id, r.status, r.last_event_seq, r.lease_epoch, r.priority, r.attempts,
              r.scheduled_for, r.failure, coalesce(open_per_run.calls, 0) AS open_calls,
              r.tenant_id, r.agent, r.session_id
),
hook_source AS (
    -- The dead-lettered runs only; a requeue is not a transition webhooks see.
    SELECT id AS run_id, tenant_id, agent, 'run.failed' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'failed',
                              'failure', failure) AS data
    FROM swept WHERE status = 'failed'
),
{{webhook_deliveries}},
moves AS (
    SELECT tenant_id, priority / 10 AS band, -1 AS d_running,
           CASE WHEN status = 'queued' THEN 1 ELSE 0 END AS d_queued
    FROM swept
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}},
uncertain_event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT swept.id, swept.last_event_seq - swept.open_calls - 1 + open_calls.n, 'tool.finished',
           swept.lease_epoch,
           jsonb_build_object('step', open_calls.step, 'tool', open_calls.tool,
                              'idempotency_class', open_calls.idempotency_class,
                              'outcome_status', 'uncertain',
                              'outcome', jsonb_build_object('message', CAST(:unknown AS text)),
                              'by', 'sweeper'),
           clock.now
    FROM swept JOIN open_calls ON open_calls.run_id = swept.id, clock
),
uncertain_journal AS (
    INSERT INTO tool_journal (run_id, event_seq, epoch, step, entry, tool, idempotency_class,
                              idempotency_key, outcome_status, outcome, created_at)
    SELECT swept.id, swept.last_event_seq - swept.open_calls - 1 + open_calls.n,
           swept.lease_epoch, open_calls.step, 'finished', open_calls.tool,
           open_calls.idempotency_class, open_calls.idempotency_key, 'uncertain',
           jsonb_build_object('message', CAST(:unknown AS text)), clock.now
    FROM swept JOIN open_calls ON open_calls.run_id = swept.id, clock
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT swept.id, swept.last_event_seq,
           CASE swept.status WHEN 'failed' THEN 'run.failed' ELSE 'run.requeued' END,
           swept.lease_epoch,
           CASE swept.status
               WHEN 'failed' THEN jsonb_build_object('failure', swept.failure)
               ELSE jsonb_build_object('reason', 'lease_expired', 'attempts', swept.attempts,
                                       'retry_at', swept.scheduled_for)
           END,
           clock.now
    FROM swept, clock
)
SELECT count(*) FILTER (WHERE status = 'queued') AS requeued,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       (SELECT coalesce(jsonb_object_agg(k, n), '{}'::jsonb)
        FROM (SELECT status || ':' || priority AS k, count(*) AS n
              FROM swept GROUP BY 1) AS per_class) AS by_priority,
       -- Bounded whatever the batch (see the header): requeues wake claimers by priority,
       -- dead-lettered runs wake their watchers by id prefix.
       CASE WHEN count(*) > 0 THEN pg_notify('turnstile', jsonb_build_object(
           -- Deliveries of dead-lettered runs are async work (10) too.
           'work', coalesce(jsonb_agg(DISTINCT priority) FILTER (WHERE status = 'queued'),
                            '[]'::jsonb)
                   || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '[10]'::jsonb
                           ELSE '[]'::jsonb END,
           'runs', coalesce((SELECT jsonb_agg(left(named.id::text, 8))
                             FROM (SELECT id FROM swept WHERE status = 'failed' LIMIT 500)
                                 AS named), '[]'::jsonb),
           'more', count(*) FILTER (WHERE status = 'failed') > 500)::text) END AS notified
FROM swept;


-- name: deliver_input
-- Input delivery to a run waiting for the user (not a worker write: guarded by the waiting
-- status instead of an epoch). The same run goes back to the queue, priority unchanged; the
-- answer is stored as the run's next input.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs r
    SET status = 'queued',
        question = NULL,
        -- The answer's trace, when it sent one, is the one the resumed work joins: the
        -- caller waiting on this answer follows it there.
        traceparent = coalesce(CAST(:traceparent AS text), r.traceparent),
        inputs_count = r.inputs_count + 1,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM clock
    WHERE r.id = :run_id AND r.status = 'waiting_for_user'
    RETURNING r.*
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.input_delivered', run.lease_epoch,
           jsonb_build_object('input_index', run.inputs_count, 'principal', CAST(:principal AS text)),
           clock.now
    FROM run, clock
),
moves AS (
    SELECT tenant_id, priority / 10 AS band, 0 AS d_running, 1 AS d_queued FROM run
),
{{count_moves}},
answer AS (
    INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
    SELECT run.id, run.inputs_count, CAST(:input AS jsonb), :principal, run.last_event_seq,
           clock.now
    FROM run, clock
)
SELECT run.*,
       pg_notify('turnstile', jsonb_build_object(
           'work', jsonb_build_array(run.priority),
           'runs', jsonb_build_array(left(run.id::text, 8)))::text)
FROM run;


-- name: cancel
-- Cancellation from any non-terminal status, in one statement: cancelled, lease cleared, epoch
-- bumped (so a worker executing the run is fenced at its next write or heartbeat) and
-- run.cancelled written. Zero rows: the run is missing, not visible to :tenant_id and
-- :principal, or already finished; the caller reads which.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
locked AS MATERIALIZED (
    -- The run's status as it is when locked (a claim may commit while this waits for the row):
    -- the counts move from that status, not from the one in this statement's snapshot.
    SELECT id, status AS was FROM runs
    WHERE id = :run_id AND status IN ('queued', 'running', 'waiting_for_user')
      AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
      AND (CAST(:principal AS text) IS NULL OR principal = :principal)
    FOR UPDATE
),
run AS (
    UPDATE runs r
    SET status = 'cancelled',
        lease_epoch = r.lease_epoch + 1,
        lease_owner = NULL,
        lease_expires_at = NULL,
        question = NULL,
        finished_at = clock.now,
        last_event_seq = r.last_event_seq + 1,
        updated_at = clock.now
    FROM clock, locked
    WHERE r.id = locked.id
      AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
      AND (CAST(:principal AS text) IS NULL OR r.principal = :principal)
      AND r.status IN ('queued', 'running', 'waiting_for_user')
    RETURNING r.*
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'run.cancelled', run.lease_epoch,
           jsonb_build_object('by', CAST(:actor AS text), 'reason', CAST(:reason AS text)), clock.now
    FROM run, clock
),
hook_source AS (
    SELECT id AS run_id, tenant_id, agent, 'run.cancelled' AS event,
           jsonb_build_object('run_id', id, 'session_id', session_id, 'status', 'cancelled',
                              'reason', CAST(:reason AS text)) AS data
    FROM run
),
{{webhook_deliveries}},
moves AS (
    SELECT run.tenant_id, run.priority / 10 AS band,
           CASE WHEN locked.was = 'running' THEN -1 ELSE 0 END AS d_running,
           CASE WHEN locked.was = 'queued' THEN -1 ELSE 0 END AS d_queued
    FROM run JOIN locked ON locked.id = run.id
    UNION ALL
    SELECT tenant_id, 1, 0, 1 FROM hook  -- its webhook deliveries: queued async runs
),
{{count_moves}}
SELECT run.*,
       pg_notify('turnstile', (jsonb_build_object(
           'runs', jsonb_build_array(left(run.id::text, 8)))
           || CASE WHEN EXISTS (SELECT 1 FROM hook) THEN '{"work": [10]}'::jsonb ELSE '{}'::jsonb END)::text)
FROM run CROSS JOIN (SELECT count(*) FROM move_clear) AS cleared;


-- ============================================================================================
-- Replays of fenced writes whose outcome is unknown (issue 19; docs/adr/0002, "Replays").
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


-- name: recognise_save_checkpoint
-- As append_event: the latest event of this epoch is this checkpoint (step and state).
SELECT e.seq FROM run_events e
JOIN checkpoints c ON c.run_id = e.run_id AND c.event_seq = e.seq
WHERE e.run_id = :run_id
  AND e.seq = (SELECT max(l.seq) FROM run_events l
               WHERE l.run_id = :run_id AND l.epoch = :epoch)
  AND e.type = 'run.checkpoint' AND c.step = :step AND c.state = CAST(:state AS jsonb);


-- name: recognise_wait_for_user
-- run.waiting ends the hold: one per epoch, written only by its holder.
SELECT e.seq FROM run_events e
WHERE e.run_id = :run_id AND e.epoch = :epoch AND e.type = 'run.waiting';


-- name: recognise_complete
-- run.succeeded is terminal and written only by the holder.
SELECT e.seq, r.priority FROM run_events e JOIN runs r ON r.id = e.run_id
WHERE e.run_id = :run_id AND e.epoch = :epoch AND e.type = 'run.succeeded';


-- name: recognise_complete_many
-- complete's read for each (run, epoch) of the batch, in complete_many's result shape.
SELECT coalesce(array_agg(e.run_id), '{}') AS ids,
       coalesce(array_agg(e.epoch), '{}') AS epochs,
       coalesce(array_agg(e.seq), '{}') AS seqs,
       coalesce(array_agg(r.priority), '{}') AS priorities
FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[])) AS h(run_id, epoch)
JOIN run_events e ON e.run_id = h.run_id AND e.epoch = h.epoch AND e.type = 'run.succeeded'
JOIN runs r ON r.id = h.run_id;


-- name: recognise_fail
-- run.failed of this epoch with this failure's kind: the sweeper's dead letter is
-- 'lease_expired', an early release's 'attempts_exhausted'.
SELECT e.seq, r.priority FROM run_events e JOIN runs r ON r.id = e.run_id
WHERE e.run_id = :run_id AND e.epoch = :epoch AND e.type = 'run.failed'
  AND (e.data -> 'failure' ->> 'kind') IS NOT DISTINCT FROM (CAST(:failure AS jsonb) ->> 'kind');


-- name: recognise_release_graceful
SELECT e.seq, r.priority FROM run_events e JOIN runs r ON r.id = e.run_id
WHERE e.run_id = :run_id AND e.epoch = :epoch AND e.type = 'run.released'
  AND e.data ->> 'graceful' = 'true';


-- name: recognise_release_early
-- Requeued (run.released, not graceful) or, on the last attempt, dead-lettered with
-- 'attempts_exhausted' (the sweeper's dead letter is 'lease_expired').
SELECT e.seq, r.priority,
       CASE e.type WHEN 'run.failed' THEN 'failed' ELSE 'queued' END AS status
FROM run_events e JOIN runs r ON r.id = e.run_id
WHERE e.run_id = :run_id AND e.epoch = :epoch
  AND ((e.type = 'run.released' AND e.data ->> 'graceful' = 'false')
       OR (e.type = 'run.failed' AND e.data -> 'failure' ->> 'kind' = 'attempts_exhausted'));
