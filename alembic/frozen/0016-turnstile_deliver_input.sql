CREATE OR REPLACE FUNCTION turnstile_deliver_input(
    p_now timestamptz,        -- NULL: now()
    p_run_id uuid,
    p_input jsonb,
    p_principal text,         -- who answered
    p_traceparent text        -- the answer's trace context, or NULL
)
RETURNS SETOF runs
LANGUAGE plpgsql VOLATILE AS $fn$
-- The one way an answer reaches a run waiting for the user (ADR-0004: the answer resumes the
-- same run): the run back to queued, priority unchanged, the answer stored as its next input
-- with its run.input_delivered event, and its tenant's count row marked in the same update
-- that holds it. Guarded by the waiting status, not an epoch (no worker holds the run): no
-- row back when the run is not waiting (any more). The caller sends the notification.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    RETURN QUERY
    WITH delivered AS (
        UPDATE runs r
        SET status = 'queued',
            question = NULL,
            -- The answer's trace, when it sent one, is the one the resumed work joins.
            traceparent = coalesce(p_traceparent, r.traceparent),
            inputs_count = r.inputs_count + 1,
            last_event_seq = r.last_event_seq + 1,
            updated_at = v_now
        WHERE r.id = p_run_id AND r.status = 'waiting_for_user'
        RETURNING r.*
    ),
    event AS (
        INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
        SELECT d.id, d.last_event_seq, 'run.input_delivered', d.lease_epoch,
               jsonb_build_object('input_index', d.inputs_count, 'principal', p_principal),
               v_now
        FROM delivered d
    ),
    answer AS (
        INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
        SELECT d.id, d.inputs_count, p_input, p_principal, d.last_event_seq, v_now
        FROM delivered d
    ),
    counted AS (
        -- Work to claim now: has_work, set in the update that holds the row, so a settle
        -- running meanwhile cannot clear it under this run (turnstile_settle_work).
        INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued, has_work)
        SELECT d.tenant_id, CAST(d.priority / 10 AS smallint), 0, 0, true FROM delivered d
        ON CONFLICT (tenant_id, band) DO UPDATE SET has_work = true, due_at = NULL
    )
    SELECT * FROM delivered;
END
$fn$;
