-- Submission: idempotency keys, sessions and the routing of a turn. All of these run inside the
-- one transaction of a submission (app/queue/submit.py), so a refused turn leaves nothing.

-- name: idempotency_claim
-- Take the key for this request (turnstile_claim_key, as turnstile_submit takes it): true
-- when taken. A concurrent twin's uncommitted insert makes this wait on the unique index
-- (bounded by a per-statement lock_timeout), then see its committed row.
SELECT turnstile_claim_key({{now}}, :tenant_id, :principal, :key, :request_hash,
                           CAST(:ttl_seconds AS double precision)) AS taken;


-- name: idempotency_stored
SELECT request_hash, response_status, response_body, run_id FROM idempotency_keys
WHERE tenant_id = :tenant_id AND principal = :principal AND key = :key;


-- name: idempotency_peek
-- A look at a key without taking it: the stored outcome of a request made before, while it
-- lasts. The A2A surface asks this before it creates the session a first message needs, so a
-- retried first message starts no second session (app/api/a2a_routes.py).
SELECT request_hash, response_status, response_body, run_id FROM idempotency_keys
WHERE tenant_id = :tenant_id AND principal = :principal AND key = :key
  AND expires_at > {{now}};


-- name: idempotency_store
-- Only 2xx outcomes reach this statement; a refused submission rolls its key back with it.
UPDATE idempotency_keys
SET response_status = :response_status, response_body = CAST(:response_body AS jsonb),
    run_id = :run_id
WHERE tenant_id = :tenant_id AND principal = :principal AND key = :key;


-- name: create_session
-- The metadata is a conversation's (the OpenAI Conversations API), checked by the caller;
-- every other session starts with none. The multitask policy: docs/turn-control.md.
-- Its approval policy (docs/approvals.md), NULL for the process default.
INSERT INTO sessions (tenant_id, principal, created_at, last_activity_at, metadata, multitask,
                      approval)
VALUES (:tenant_id, :principal, {{now}}, {{now}}, CAST(:metadata AS jsonb), :multitask,
        CAST(:approval AS jsonb))
RETURNING id, tenant_id, principal, created_at, last_activity_at, metadata, multitask, approval;


-- name: update_session_metadata
-- A conversation's update (POST /v1/conversations/{id}): the keys given are set, the others
-- kept, as OpenAI's API does. The pairs are counted on the merged object in the same
-- statement, so two concurrent updates cannot together pass the bound the caller checked
-- for each: an update past it writes nothing (updated false). No row: no such session for
-- this caller.
WITH target AS MATERIALIZED (
    SELECT s.id, s.metadata || CAST(:metadata AS jsonb) AS merged FROM sessions s
    WHERE s.id = :session_id AND s.tenant_id = :tenant_id
      AND (CAST(:principal AS text) IS NULL OR s.principal = :principal)
    FOR UPDATE
),
changed AS (
    UPDATE sessions s SET metadata = t.merged
    FROM target t
    WHERE s.id = t.id AND (SELECT count(*) FROM jsonb_object_keys(t.merged)) <= :max_pairs
    RETURNING s.metadata
)
SELECT (SELECT metadata FROM changed) IS NOT NULL AS updated,
       (SELECT count(*) FROM jsonb_object_keys(t.merged)) AS pairs
FROM target t;


-- name: discard_empty_session
-- A session made for a first message whose turn was then refused (rate limit, quota): removed
-- again, so a refusal leaves nothing behind. Only while no run names it, so a session that
-- has taken a turn meanwhile is never touched.
DELETE FROM sessions s
WHERE s.id = :session_id AND s.tenant_id = :tenant_id
  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.session_id = s.id);


-- name: lock_session
-- Every submission to a session takes its row first, so routing decisions on one session are
-- made one at a time. :principal (None for operator keys) keeps a plain key to its own
-- principal's sessions in the same statement: another principal's session is not found.
-- Its principal comes back: a run created in a session is the session owner's, whoever posted
-- the turn (an operator's turn must not hide the run from the session's own user).
-- The session's last activity is set in the same statement (session retention reads it): the
-- row is taken FOR UPDATE first, as before, so the lock mode every submission queues on is
-- unchanged (a plain UPDATE would take a weaker one).
WITH locked AS (
    SELECT id FROM sessions
    WHERE id = :session_id AND tenant_id = :tenant_id
      AND (CAST(:principal AS text) IS NULL OR principal = :principal)
    FOR UPDATE
)
UPDATE sessions s SET last_activity_at = greatest(s.last_activity_at, {{now}})
FROM locked
WHERE s.id = locked.id
RETURNING s.id, s.principal;


-- name: get_session
SELECT s.id, s.tenant_id, s.principal, s.created_at, s.last_activity_at, s.metadata, s.multitask,
       s.approval,
       (SELECT count(*) FROM pending_turns p
        WHERE p.session_id = s.id AND p.status = 'pending') AS pending_turns,
       a.id AS active_run_id, a.status AS active_status, a.question AS active_question
FROM sessions s
LEFT JOIN runs a
       ON a.session_id = s.id AND a.status IN ('queued', 'running', 'waiting_for_user')
WHERE s.id = :session_id AND (CAST(:tenant_id AS text) IS NULL OR s.tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR s.principal = :principal);


-- name: active_run_of_session
SELECT * FROM runs
WHERE session_id = :session_id AND status IN ('queued', 'running', 'waiting_for_user');


-- name: session_runs
-- Newest first, keyset-paginated on (created_at, id).
SELECT * FROM runs
WHERE session_id = :session_id
  AND (CAST(:before_created AS timestamptz) IS NULL
       OR (created_at, id) < (CAST(:before_created AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY created_at DESC, id DESC
LIMIT :limit;


-- Operator actions on finished runs. They record an `operator.*` event naming the acting key;
-- such events are not transitions and are the only events allowed after a terminal one
-- besides run.fenced.

-- name: dismiss
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs r
    SET dismissed_at = clock.now, last_event_seq = r.last_event_seq + 1, updated_at = clock.now
    FROM clock
    WHERE r.id = :run_id AND r.status = 'failed' AND r.dismissed_at IS NULL
      AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
    RETURNING r.*
),
event AS (
    INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
    SELECT run.id, run.last_event_seq, 'operator.dismissed', run.lease_epoch,
           jsonb_build_object('by', CAST(:actor AS text)), clock.now
    FROM run, clock
)
SELECT * FROM run;


-- name: lock_failed_run
-- A resubmission takes the failed run's row first (after its session's, in the submission lock
-- order: sessions, then runs), so two resubmissions of one run are decided one at a time.
SELECT * FROM runs
WHERE id = :run_id AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
FOR UPDATE;


-- name: resubmission_of
-- The run an earlier resubmission of this failed run created (uq_runs_resubmitted_from: at most
-- one), read in a statement of its own so that it sees what a rival committed while we waited.
SELECT * FROM runs WHERE resubmitted_from = :run_id;


-- name: operator_event
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id
    RETURNING id, last_event_seq, lease_epoch
)
INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
SELECT run.id, run.last_event_seq, :type, run.lease_epoch, CAST(:data AS jsonb), clock.now
FROM run, clock
RETURNING seq;


-- name: submit
-- A turn or a sessionless run in one round trip: `turnstile_submit`
-- (app/store/functions/turnstile_submit.sql) takes the key, locks the session, routes,
-- enqueues or delivers, and stores the answer, each step a statement with a fresh snapshot. Positional parameters: it runs on the driver's own
-- connection (Queue.call), prepared once per connection. The run's columns are spread out so
-- the driver decodes them by type, as for every other run row. With a submission rate limit
-- it also takes a token from the tenant's bucket and returns the bucket's
-- figures (rate_limit NULL: no limit) for the RateLimit headers; over the limit it raises
-- TS429 before writing a run.
SELECT r.outcome, r.stored_status, r.stored_body, r.stored_run_id,
       r.rate_limit, r.rate_burst, r.rate_tokens, (r.the_run).*
FROM turnstile_submit(
    p_now => $1, p_tenant => $2, p_principal => $3, p_own_sessions_only => $4,
    p_actor => $5, p_session => $6, p_key => $7, p_request_hash => $8, p_ttl_seconds => $9,
    p_wait_ms => $10, p_lock_timeout_ms => $11, p_run_id => $12, p_agent => $13,
    p_default_agent => $14, p_priority => $15, p_default_priority => $16,
    p_scheduled_for => $17, p_input => $18, p_max_attempts => $19,
    p_traceparent => $20, p_max_queued => $21, p_submit_rate => $22, p_submit_burst => $23,
    p_start_within => $24, p_start_before => $25, p_approval => $26) r;


-- name: submit_many
-- The submissions one API process received together, in one transaction with one commit and
-- one notification (`turnstile_submit_many`, app/store/functions/turnstile_submit_many.sql;
-- app/queue/submit_batches.py gathers them). One row per submission, in the order given,
-- each with its own outcome or its own refusal.
SELECT r.item, r.refusal, r.refusal_code, r.refusal_detail, r.outcome, r.stored_status,
       r.stored_body, r.stored_run_id, r.rate_limit, r.rate_burst, r.rate_tokens,
       (r.the_run).*
FROM turnstile_submit_many(
    p_now => :now, p_tenants => :tenants, p_principals => :principals,
    p_own_sessions_only => :own_sessions_only, p_actors => :actors, p_sessions => :sessions,
    p_keys => :keys, p_request_hashes => :request_hashes, p_run_ids => :run_ids,
    p_agents => :agents, p_priorities => :priorities,
    p_default_priorities => :default_priorities, p_scheduled_fors => :scheduled_fors,
    p_inputs => :inputs, p_traceparents => :traceparents, p_start_withins => :start_withins,
    p_start_befores => :start_befores, p_approvals => :approvals,
    p_ttl_seconds => :ttl_seconds, p_wait_ms => :wait_ms,
    p_lock_timeout_ms => :lock_timeout_ms, p_default_agent => :default_agent,
    p_max_attempts => :max_attempts, p_max_queued => :max_queued,
    p_submit_rate => :submit_rate, p_submit_burst => :submit_burst) r
ORDER BY r.item;


-- Multitask policies (docs/turn-control.md): turns that arrive while the session's run is
-- queued or running, kept as pending turns until the run ends, interrupts it, or steers it.

-- name: set_session_approval
-- A session's approval policy (docs/approvals.md); NULL: the process default. Read by its
-- runs when they reach a tool call, so it applies from their next one.
UPDATE sessions SET approval = CAST(:approval AS jsonb)
WHERE id = :session_id AND tenant_id = :tenant_id
  AND (CAST(:principal AS text) IS NULL OR principal = :principal)
RETURNING id;


-- name: session_approval
-- The approval policy a run of this session works under when its own turn gave none.
SELECT approval FROM sessions WHERE id = :session_id;


-- name: set_run_approval
-- A turn's approval policy on the run it created (the multitask path,
-- app/queue/turns.py), in the transaction that created it.
UPDATE runs SET approval = CAST(:approval AS jsonb) WHERE id = :run_id
RETURNING *;


-- name: lock_run_for_approval
-- The run an approval names (POST /runs/{id}/approval), locked: two approvals of one call
-- take turns here, and the second finds it no longer waiting.
SELECT * FROM runs WHERE id = :run_id FOR UPDATE;


-- name: set_session_multitask
UPDATE sessions SET multitask = :multitask
WHERE id = :session_id AND tenant_id = :tenant_id
  AND (CAST(:principal AS text) IS NULL OR principal = :principal)
RETURNING id;


-- name: session_multitask
-- The session's policy, read when a turn found its session busy and set no policy itself.
SELECT multitask FROM sessions
WHERE id = :session_id AND tenant_id = :tenant_id
  AND (CAST(:principal AS text) IS NULL OR principal = :principal);


-- name: lock_active_run
-- A policy's submission takes the session's active run row after the session's (the
-- submission lock order: sessions, then runs): an ending transaction either committed before
-- (this returns nothing; the caller reads again, with a fresh snapshot, for the run it may
-- have promoted) or waits for this one, and then promotes the turn this one adds.
SELECT * FROM runs
WHERE session_id = :session_id AND status IN ('queued', 'running', 'waiting_for_user')
FOR UPDATE;


-- name: add_pending_turn
-- A pending turn, refused (no row) when the session already holds :max_pending of them; the
-- caller holds the session's row, so the count cannot change under it. Its position: 1 is
-- next (an interrupt's turn goes first).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
waiting AS (
    SELECT count(*) AS n FROM pending_turns
    WHERE session_id = :session_id AND status = 'pending'
),
added AS (
    INSERT INTO pending_turns (id, tenant_id, session_id, principal, submitted_by, actor,
                               policy, agent, priority, input, max_attempts, traceparent,
                               active_run_id, interrupt_by, start_before, created_at,
                               updated_at)
    SELECT :id, :tenant_id, :session_id, :principal, :submitted_by, :actor, :policy, :agent,
           :priority, CAST(:input AS jsonb), :max_attempts, :traceparent, :active_run_id,
           CASE WHEN :policy = 'interrupt'
                THEN clock.now + make_interval(secs => :interrupt_grace_seconds) END,
           -- Its deadline to start, from its acceptance; the run it becomes takes it.
           {{start_before}},
           clock.now, clock.now
    FROM waiting, clock
    WHERE waiting.n < :max_pending
    RETURNING *
)
SELECT added.*,
       CASE WHEN added.policy = 'interrupt'
            THEN 1 + (SELECT count(*) FROM pending_turns p
                      WHERE p.session_id = added.session_id AND p.status = 'pending'
                        AND p.policy = 'interrupt')
            ELSE (SELECT n FROM waiting) + 1 END AS position
FROM added;


-- name: turn_event
-- An event of a session's active run about a turn (turn.pending, turn.cancelled,
-- run.interrupted), under the caller's lock of the run row. Not a worker's write: no fence,
-- but only while the run is active (events after a terminal one are the operator's alone).
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS (
    UPDATE runs SET last_event_seq = last_event_seq + 1
    WHERE id = :run_id AND status IN ('queued', 'running', 'waiting_for_user')
    RETURNING id, last_event_seq, lease_epoch, session_id
)
INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
SELECT run.id, run.last_event_seq, :type, run.lease_epoch, CAST(:data AS jsonb), clock.now
FROM run, clock
RETURNING seq, (SELECT pg_notify('turnstile', jsonb_build_object(
                   'runs', jsonb_build_array(left(run.id::text, 8)),
                   'sessions', jsonb_build_array(left(run.session_id::text, 8)))::text)
                FROM run) AS notified;


-- name: pending_turn
-- A pending turn as its user follows it, with its position while it is pending.
SELECT p.*,
       CASE WHEN p.status = 'pending' THEN
           (SELECT count(*) FROM pending_turns o
            WHERE o.session_id = p.session_id AND o.status = 'pending'
              AND ((o.policy = 'interrupt') > (p.policy = 'interrupt')
                   OR ((o.policy = 'interrupt') = (p.policy = 'interrupt') AND o.seq <= p.seq)))
       END AS position
FROM pending_turns p
WHERE p.id = :turn_id AND p.session_id = :session_id;


-- name: visible_pending_turn
-- A pending turn by its id alone, as a caller that was given it as a task (docs/a2a.md) looks
-- it up: :tenant_id and :principal limit what a key sees (None, no limit on that column), as
-- get_run does for runs (the turn's principal is its session's owner, as its run's will be).
SELECT p.*,
       CASE WHEN p.status = 'pending' THEN
           (SELECT count(*) FROM pending_turns o
            WHERE o.session_id = p.session_id AND o.status = 'pending'
              AND ((o.policy = 'interrupt') > (p.policy = 'interrupt')
                   OR ((o.policy = 'interrupt') = (p.policy = 'interrupt') AND o.seq <= p.seq)))
       END AS position
FROM pending_turns p
WHERE p.id = :turn_id
  AND (CAST(:tenant_id AS text) IS NULL OR p.tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR p.principal = :principal);


-- name: waiting_turns_of_session
-- A session's pending turns newest first, as a context's task list shows them beside its
-- runs (the partial index on pending ones; withdrawn turns are not listed, that would scan).
SELECT p.*, NULL::bigint AS position
FROM pending_turns p
WHERE p.session_id = :session_id AND p.status = 'pending'
  AND (CAST(:tenant_id AS text) IS NULL OR p.tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR p.principal = :principal)
ORDER BY p.seq DESC
LIMIT :limit;


-- name: pending_turns_of_session
-- A session's pending turns in the order they will start.
SELECT p.*, row_number() OVER (ORDER BY (p.policy = 'interrupt') DESC, p.seq) AS position
FROM pending_turns p
WHERE p.session_id = :session_id AND p.status = 'pending'
ORDER BY (p.policy = 'interrupt') DESC, p.seq;


-- name: cancel_pending_turn
-- A user withdraws a pending turn. A promotion holding it is waited for; then the turn has
-- started (or was delivered), nothing changes, and the caller reads which.
UPDATE pending_turns SET status = 'cancelled', updated_at = {{now}}
WHERE id = :turn_id AND session_id = :session_id AND status = 'pending'
RETURNING *;


-- name: promote_stranded_turns
-- The backstop of the sweep: sessions with pending turns and no active run (a run an older
-- release ended, which does not promote) start their next one.
SELECT r.id FROM turnstile_promote_turns({{now}}, ARRAY(
    SELECT DISTINCT p.session_id FROM pending_turns p
    WHERE p.status = 'pending'
      AND NOT EXISTS (SELECT 1 FROM runs a
                      WHERE a.session_id = p.session_id
                        AND a.status IN ('queued', 'running', 'waiting_for_user'))
    LIMIT :limit)) AS r;


-- name: overdue_interrupts
-- Interrupts whose bound passed while their run had not stopped at a boundary (a long tool
-- call, a dead worker): the sweep ends those runs as a cancel would.
SELECT p.id AS turn_id, p.active_run_id AS run_id FROM pending_turns p
WHERE p.status = 'pending' AND p.policy = 'interrupt' AND p.interrupt_by < {{now}}
ORDER BY p.interrupt_by
LIMIT :limit;
