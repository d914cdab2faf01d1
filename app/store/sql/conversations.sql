-- The deletions the OpenAI Responses API asks for (app/api/conversation_routes.py and
-- responses_routes.py, through app/queue/reads.py): a conversation (a session, with its runs)
-- and a response (a finished sessionless run).


-- name: delete_idle_session
-- After lock_session, in the same transaction: this statement's snapshot is taken after the
-- lock, so a turn that committed while this waited for the session row is seen (its active
-- run makes this delete nothing). A failed run not dismissed keeps it too: the dead letter is
-- never emptied behind the operator's back, as retention keeps it. The session's runs go in
-- the same statement, as retention deletes them (the foreign key is checked at the statement's end, when they are gone); their
-- events, inputs, checkpoints, journal and webhook deliveries follow by cascade. Its idempotency
-- keys are not touched: they expire on their own TTL. With only_run set (a response's delete, for
-- the session of a chain of responses) the session goes only while that run is its only one,
-- decided under the same lock, so a response chained onto it meanwhile is never deleted.
WITH target AS MATERIALIZED (
    SELECT s.id FROM sessions s
    WHERE s.id = :session_id AND s.tenant_id = :tenant_id
      AND (CAST(:principal AS text) IS NULL OR s.principal = :principal)
),
idle AS MATERIALIZED (
    SELECT t.id FROM target t
    WHERE NOT EXISTS (
        SELECT 1 FROM runs r
        WHERE r.session_id = t.id
          AND (r.finished_at IS NULL OR (r.status = 'failed' AND r.dismissed_at IS NULL)))
      AND (CAST(:only_run AS uuid) IS NULL OR NOT EXISTS (
          SELECT 1 FROM runs r WHERE r.session_id = t.id AND r.id <> CAST(:only_run AS uuid)))
),
gone_runs AS (
    DELETE FROM runs WHERE session_id IN (SELECT id FROM idle)
    RETURNING id
),
gone AS (
    DELETE FROM sessions WHERE id IN (SELECT id FROM idle)
    RETURNING id
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM gone) AS deleted,
       EXISTS (SELECT 1 FROM runs r JOIN target t ON r.session_id = t.id
               WHERE r.finished_at IS NULL) AS active,
       EXISTS (SELECT 1 FROM runs r JOIN target t ON r.session_id = t.id
               WHERE r.id <> CAST(:only_run AS uuid)) AS others;


-- name: delete_finished_run
-- A finished run outside any session (a run of a session is part of its transcript: the
-- conversation is deleted whole), with its events, inputs, checkpoints and journal (ON DELETE
-- CASCADE). A run still going is never deleted under its worker: the row is locked first (a
-- transition holding it is waited for, then the row rechecked), and only a finished one goes.
-- A failed run not dismissed stays, as retention keeps it: the dead letter is the operator's.
-- No row: the caller sees no such run.
WITH target AS MATERIALIZED (
    SELECT id, session_id, status, finished_at, dismissed_at FROM runs
    WHERE id = :run_id AND tenant_id = :tenant_id
      AND (CAST(:principal AS text) IS NULL OR principal = :principal)
    FOR UPDATE
),
gone AS (
    DELETE FROM runs r USING target t
    WHERE r.id = t.id AND t.session_id IS NULL AND t.finished_at IS NOT NULL
      AND (t.status <> 'failed' OR t.dismissed_at IS NOT NULL)
    RETURNING r.id
)
SELECT t.session_id IS NOT NULL AS in_session,
       t.status = 'failed' AND t.dismissed_at IS NULL AS dead_letter,
       (SELECT count(*) FROM gone) AS deleted
FROM target t;
