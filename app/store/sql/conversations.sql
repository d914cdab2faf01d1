-- The deletions the OpenAI Responses API asks for (app/api/conversation_routes.py and
-- responses_routes.py, through app/queue/reads.py): a conversation (a session, with its runs)
-- and a response (a finished sessionless run).


-- name: delete_idle_session
-- After lock_session, in the same transaction: this statement's snapshot is taken after the
-- lock, so a turn that committed while this waited for the session row is seen (its active
-- run makes this delete nothing). The session's runs go in the same statement, as retention
-- deletes them (the foreign key is checked at the statement's end, when they are gone); their
-- events, inputs, checkpoints, journal and webhook deliveries follow by cascade. Its idempotency
-- keys are not touched: they expire on their own TTL.
WITH target AS MATERIALIZED (
    SELECT s.id FROM sessions s
    WHERE s.id = :session_id AND s.tenant_id = :tenant_id
      AND (CAST(:principal AS text) IS NULL OR s.principal = :principal)
),
idle AS MATERIALIZED (
    SELECT t.id FROM target t
    WHERE NOT EXISTS (
        SELECT 1 FROM runs r WHERE r.session_id = t.id AND r.finished_at IS NULL)
),
gone_runs AS (
    DELETE FROM runs WHERE session_id IN (SELECT id FROM idle)
    RETURNING id
),
gone AS (
    DELETE FROM sessions WHERE id IN (SELECT id FROM idle)
    RETURNING id
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT count(*) FROM gone) AS deleted;


-- name: delete_finished_run
-- A finished run outside any session (a run of a session is part of its transcript: the
-- conversation is deleted whole). A run still going is never deleted under its worker: only
-- finished rows match, and a row a transition holds is waited for, then rechecked.
DELETE FROM runs
WHERE id = :run_id AND tenant_id = :tenant_id
  AND (CAST(:principal AS text) IS NULL OR principal = :principal)
  AND session_id IS NULL AND finished_at IS NOT NULL
RETURNING id;
