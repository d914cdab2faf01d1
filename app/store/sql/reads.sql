-- Reads of runs: a run, its checkpoint, inputs, journal and events (the worker's resume and the
-- API's), and the runbook's reads (depth, stuck runs, the dead letter). None of them writes.
-- {{now}} is the injectable clock, as everywhere (app/store/statements.py).


-- name: get_run
-- :tenant_id and :principal limit what a key sees (None: no limit on that column).
SELECT * FROM runs
WHERE id = :run_id AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR principal = :principal);


-- name: latest_checkpoint
SELECT event_seq, epoch, step, state FROM checkpoints
WHERE run_id = :run_id
ORDER BY event_seq DESC
LIMIT 1;


-- name: run_inputs
SELECT idx, input, principal, event_seq, created_at FROM run_inputs
WHERE run_id = :run_id
ORDER BY idx;


-- name: tool_journal
SELECT event_seq, epoch, step, entry, tool, idempotency_class, idempotency_key, args,
       outcome_status, outcome
FROM tool_journal
WHERE run_id = :run_id
ORDER BY event_seq;


-- name: resume_state
-- Everything a claimed run resumes from, in one round trip instead of three: its latest
-- checkpoint, every input delivered to it (in order) and its tool journal (in sequence order).
-- A plain read: what it returns is only acted on through fenced writes.
SELECT (SELECT to_jsonb(c)
        FROM (SELECT event_seq, epoch, step, state FROM checkpoints
              WHERE run_id = :run_id
              ORDER BY event_seq DESC
              LIMIT 1) AS c) AS checkpoint,
       (SELECT coalesce(jsonb_agg(i.input ORDER BY i.idx), '[]'::jsonb)
        FROM run_inputs i
        WHERE i.run_id = :run_id) AS inputs,
       (SELECT coalesce(jsonb_agg(to_jsonb(j) ORDER BY j.event_seq), '[]'::jsonb)
        FROM (SELECT event_seq, epoch, step, entry, tool, idempotency_class, idempotency_key,
                     args, outcome_status, outcome
              FROM tool_journal
              WHERE run_id = :run_id) AS j) AS journal;

-- name: run_events
SELECT seq, type, epoch, data, created_at FROM run_events
WHERE run_id = :run_id AND seq > :after
ORDER BY seq
LIMIT :limit;


-- name: watch_events
-- An event stream's recheck in one statement: where the run stands (status, last sequence
-- number, when it is due) and the events after :after, if any, from one snapshot. One row
-- with null event columns when nothing is new; zero rows when the run is gone or not visible
-- to :tenant_id and :principal (None: no limit on that column).
SELECT r.status, r.last_event_seq, r.scheduled_for,
       e.seq, e.type, e.epoch, e.data, e.created_at
FROM runs r
LEFT JOIN LATERAL (
    SELECT seq, type, epoch, data, created_at FROM run_events
    WHERE run_id = r.id AND seq > :after AND r.last_event_seq > :after
    ORDER BY seq
    LIMIT :limit
) e ON true
WHERE r.id = :run_id
  AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
  AND (CAST(:principal AS text) IS NULL OR r.principal = :principal)
ORDER BY e.seq;


-- name: watch_session_events
-- A session stream's recheck in one statement (GET /sessions/{id}/events): the session's first
-- run numbered :from_run_no or later (its run numbers have gaps only where retention deleted
-- runs), where it stands, whether a later run exists, and its events after :after (after 0
-- when it is a later run than :from_run_no), from one snapshot. One row with null event columns
-- when nothing is new; zero rows when the session has no such run. Both reads go through
-- uq_runs_session_id_session_run_no; the caller checked the session's tenant and principal.
WITH cur AS MATERIALIZED (
    SELECT id, session_run_no, status, last_event_seq, scheduled_for,
           CASE WHEN session_run_no = :from_run_no THEN CAST(:after AS bigint) ELSE 0 END
               AS after_seq
    FROM runs
    WHERE session_id = :session_id AND session_run_no >= :from_run_no
    ORDER BY session_run_no
    LIMIT 1
)
SELECT cur.id AS run_id, cur.session_run_no AS run_no, cur.status, cur.last_event_seq,
       cur.scheduled_for,
       EXISTS (SELECT 1 FROM runs n
               WHERE n.session_id = :session_id AND n.session_run_no > cur.session_run_no)
           AS has_next,
       e.seq, e.type, e.epoch, e.data, e.created_at
FROM cur
LEFT JOIN LATERAL (
    SELECT seq, type, epoch, data, created_at FROM run_events
    WHERE run_id = cur.id AND seq > cur.after_seq AND cur.last_event_seq > cur.after_seq
    ORDER BY seq
    LIMIT :limit
) e ON true
ORDER BY e.seq;

-- Runbook reads: queue depth, stuck runs, the dead letter.

-- name: queue_depth
-- Runs per class and status, without a scan of the active runs (the queue-metrics service
-- reads it at every interval): running from the count rows (exact); queued and waiting runs
-- counted through their partial indexes (ix_runs_claim, ix_runs_tenant_claim, ix_runs_waiting),
-- at most :max_counted of each (past that, floors); the oldest eligible age from the head of
-- each priority of the class, one probe each.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
band AS (SELECT CAST(b AS smallint) AS b FROM generate_series(0, 2) AS b)
SELECT band.b AS class_index, 'queued' AS status,
       (SELECT count(*) FROM (
            SELECT 1 FROM runs q
            WHERE q.status = 'queued' AND q.priority BETWEEN band.b * 10 AND band.b * 10 + 9
              AND (CAST(:tenant_id AS text) IS NULL OR q.tenant_id = :tenant_id)
            LIMIT :max_counted) AS counted) AS runs,
       (SELECT extract(epoch FROM clock.now - min(h.at))
        FROM generate_series(band.b * 10, band.b * 10 + 9) AS p(priority)
        CROSS JOIN LATERAL (
            SELECT coalesce(q.scheduled_for, q.created_at) AS at FROM runs q
            WHERE q.status = 'queued' AND q.priority = p.priority
              AND coalesce(q.scheduled_for, q.created_at) <= clock.now
              AND (CAST(:tenant_id AS text) IS NULL OR q.tenant_id = :tenant_id)
            ORDER BY coalesce(q.scheduled_for, q.created_at)
            LIMIT 1) AS h) AS oldest_eligible_age
FROM band, clock
UNION ALL
SELECT c.band, 'running', sum(c.running), NULL FROM tenant_class_counts c
WHERE CAST(:tenant_id AS text) IS NULL OR c.tenant_id = :tenant_id
GROUP BY c.band
UNION ALL
SELECT w.priority / 10, 'waiting_for_user', count(*), NULL FROM (
    SELECT q.priority FROM runs q
    WHERE q.status = 'waiting_for_user'
      AND (CAST(:tenant_id AS text) IS NULL OR q.tenant_id = :tenant_id)
    LIMIT :max_counted) AS w
GROUP BY 1;


-- name: notification_queue_usage
-- The share of the cluster's NOTIFY queue in use (0..1). A full queue makes pg_notify fail,
-- and with it every notifying transition: operators alert on it (docs/operations.md).
SELECT pg_notification_queue_usage() AS usage;


-- name: stuck_runs
-- Leases expired but not yet swept; runs eligible but unclaimed for longer than a threshold;
-- runs waiting for the user for longer than a threshold.
SELECT *,
       CASE WHEN status = 'running' THEN 'lease_expired'
            WHEN status = 'queued' THEN 'queued_too_long'
            ELSE 'waiting_too_long' END AS reason
FROM runs
WHERE (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
  AND ((status = 'running' AND lease_expires_at < {{now}})
       OR (status = 'queued' AND coalesce(scheduled_for, created_at)
                                 < {{now}} - make_interval(secs => :queued_seconds))
       OR (status = 'waiting_for_user'
           AND updated_at < {{now}} - make_interval(secs => :waiting_seconds)))
ORDER BY updated_at
LIMIT :limit;


-- name: failed_runs
-- The dead letter: failed runs not dismissed yet, newest first.
SELECT * FROM runs
WHERE status = 'failed' AND dismissed_at IS NULL
  AND (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
  AND (CAST(:before_finished AS timestamptz) IS NULL
       OR (finished_at, id) < (CAST(:before_finished AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY finished_at DESC, id DESC
LIMIT :limit;


-- name: session_transcript
-- A session's conversation, oldest first, derived from what runs already record under their
-- fence (so nothing a fenced epoch tried to write can appear in it): the user's turns are the
-- run's inputs (the one that created it, then each answer delivered to it); the assistant's are
-- its questions (run.waiting) and its final message (run.succeeded: the result's "final", or
-- the whole result); each tool call with its outcome is its tool.finished event (an
-- 'uncertain' one included), its arguments taken from the journal's 'started' entry of that
-- step; a run's failed or cancelled end is a system entry. Keyed by (run number within the
-- session, the event's seq): inputs carry the seq of the event written with them.
-- Keyset page after (:after_run_no, :after_seq), within the run numbers :from_run_no through
-- :through_run_no (None: no upper bound). Every run has at least one entry (its first input),
-- so the first :limit entries after the cursor lie within the next :limit runs: the window
-- bounds the work of a page whatever the session's length.
WITH session_runs AS MATERIALIZED (
    -- uq_runs_session_id_session_run_no: the window's runs, in order.
    SELECT id, session_run_no FROM runs
    WHERE session_id = :session_id
      AND session_run_no
          BETWEEN greatest(CAST(:after_run_no AS bigint), CAST(:from_run_no AS bigint))
              AND least(greatest(CAST(:after_run_no AS bigint), CAST(:from_run_no AS bigint))
                            + CAST(:limit AS bigint),
                        coalesce(CAST(:through_run_no AS bigint), 2147483647))
)
SELECT r.session_run_no AS run_no, x.seq, r.id AS run_id, x.role, x.kind, x.content, x.tool,
       x.created_at
FROM session_runs r
-- Per run, by its primary keys (LATERAL): the planner cannot see how few runs the window
-- holds, and otherwise hashes every run's events to join a page's.
CROSS JOIN LATERAL (
    SELECT i.event_seq AS seq, 'user' AS role,
           CASE WHEN i.idx = 1 THEN 'input'
                -- A decision on a tool call (docs/approvals.md) is followed at once by its
                -- tool.approved or tool.rejected event: that, not its content, tells it.
                WHEN EXISTS (SELECT 1 FROM run_events d
                             WHERE d.run_id = i.run_id AND d.seq = i.event_seq + 1
                               AND d.type IN ('tool.approved', 'tool.rejected'))
                THEN 'approval'
                ELSE 'answer' END AS kind,
           i.input AS content, CAST(NULL AS jsonb) AS tool, i.created_at
    FROM run_inputs i
    WHERE i.run_id = r.id
    UNION ALL
    SELECT e.seq,
           CASE e.type WHEN 'tool.finished' THEN 'tool'
                       WHEN 'run.failed' THEN 'system'
                       WHEN 'run.cancelled' THEN 'system'
                       ELSE 'assistant' END,
           CASE e.type WHEN 'run.succeeded' THEN 'final'
                       WHEN 'run.waiting' THEN
                           CASE WHEN e.data -> 'approval_request' IS NOT NULL
                                THEN 'approval_request' ELSE 'question' END
                       WHEN 'tool.finished' THEN 'tool_call'
                       WHEN 'run.failed' THEN 'failed'
                       ELSE 'cancelled' END,
           CASE e.type
               WHEN 'run.succeeded' THEN
                   CASE WHEN jsonb_typeof(e.data -> 'result') = 'object'
                             AND (e.data -> 'result') ? 'final'
                        THEN e.data -> 'result' -> 'final'
                        ELSE e.data -> 'result' END
               WHEN 'run.waiting' THEN e.data -> 'question'
               WHEN 'tool.finished' THEN e.data -> 'outcome'
               WHEN 'run.failed' THEN jsonb_build_object('status', 'failed',
                                                         'failure', e.data -> 'failure')
               ELSE jsonb_build_object('status', 'cancelled', 'by', e.data -> 'by',
                                       'reason', e.data -> 'reason')
           END,
           CASE WHEN e.type = 'tool.finished' THEN jsonb_build_object(
               'name', e.data -> 'tool', 'step', e.data -> 'step',
               'status', e.data -> 'outcome_status',
               'idempotency_class', e.data -> 'idempotency_class',
               'args', (
                   -- The latest 'started' entry of the step before its outcome (a recovered
                   -- safe call starts twice); a refused call's own 'finished' entry keeps
                   -- them (docs/approvals.md).
                   SELECT j.args FROM tool_journal j
                   WHERE j.run_id = e.run_id AND j.step = CAST(e.data ->> 'step' AS integer)
                     AND j.event_seq <= e.seq
                     AND (j.entry = 'started' OR j.outcome_status = 'rejected')
                   ORDER BY j.event_seq DESC
                   LIMIT 1)) END,
           e.created_at
    FROM run_events e
    WHERE e.run_id = r.id
      AND e.type IN ('run.succeeded', 'run.waiting', 'tool.finished', 'run.failed',
                     'run.cancelled')
) x
WHERE (r.session_run_no, x.seq) > (CAST(:after_run_no AS integer), CAST(:after_seq AS bigint))
ORDER BY r.session_run_no, x.seq
LIMIT :limit;


-- name: turn_signals
-- What a running run of a session asks at each decision boundary (docs/turn-control.md): an
-- interrupt waiting for it, and whether steered input is waiting. Two probes of the partial
-- index of pending turns; nothing pending is the common answer.
SELECT (SELECT p.id FROM pending_turns p
        WHERE p.session_id = :session_id AND p.status = 'pending' AND p.policy = 'interrupt'
        ORDER BY p.seq LIMIT 1) AS interrupt_turn_id,
       EXISTS (SELECT 1 FROM pending_turns p
               WHERE p.session_id = :session_id AND p.status = 'pending'
                 AND p.policy = 'steer') AS steered;


-- name: steered_inputs
-- The steered inputs a run has taken, with where it took them: a recovered run rebuilds
-- which of its inputs were steered (the others are answers) from these.
SELECT p.input, p.input_idx, p.at_step FROM pending_turns p
WHERE p.run_id = :run_id AND p.status = 'delivered'
ORDER BY p.input_idx;
