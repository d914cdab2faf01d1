CREATE OR REPLACE FUNCTION turnstile_promote_turns(
    p_now timestamptz,        -- NULL: now()
    p_sessions uuid[]         -- sessions whose run may just have ended (NULL entries ignored)
)
RETURNS SETOF runs
LANGUAGE plpgsql VOLATILE AS $fn$
-- A session's next pending turn becomes its next run (docs/turn-control.md). Called by every
-- statement that ends runs for good (end_holds, cancel_runs) after its runs are updated, in
-- the same transaction, so a session is never left with pending turns and no active run, the
-- new run sees the previous one's transcript (it is terminal before the new run exists), and
-- a crash loses neither: both commit, or neither does. Each statement here has a snapshot of
-- its own: it sees a pending turn a submission committed while the caller waited on the run's
-- row (the submission holds that row while it adds the turn).
--
-- Order: an interrupt's turn first (it asked to be next), then by acceptance (seq). A turn
-- being cancelled by its user is waited for; one cancelled meanwhile is skipped. The run is
-- created through turnstile_create_runs, exempt from the queued quota (the turn was admitted
-- when it was accepted). A session that still has an active run is left alone. Lock order:
-- the ended run's row (the caller's), then the pending turn's; the session row is not taken
-- (a submission holds it while it waits for the run's row). One notification per promoted run.
--
-- The run takes the pending turn's own id (migration 0024): a caller that followed the turn
-- (an A2A task, docs/a2a.md) follows the run under the id it already has. Both are random
-- uuids from different tables, so the id is free in runs; pending_turns.run_id is still set.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_session uuid;
    v_turn pending_turns;
    v_run runs;
BEGIN
    FOR v_session IN
        SELECT DISTINCT s FROM unnest(p_sessions) AS s WHERE s IS NOT NULL ORDER BY 1
    LOOP
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM runs a
            WHERE a.session_id = v_session
              AND a.status IN ('queued', 'running', 'waiting_for_user'));
        v_turn := NULL;
        FOR attempt IN 1..3 LOOP
            -- FOR UPDATE re-checks a row a cancel committed while this waited; LIMIT 1 then
            -- returns nothing rather than the next one, hence the loop.
            SELECT * INTO v_turn FROM pending_turns p
            WHERE p.session_id = v_session AND p.status = 'pending'
            ORDER BY (p.policy = 'interrupt') DESC, p.seq
            LIMIT 1
            FOR UPDATE;
            EXIT WHEN FOUND;
            EXIT WHEN NOT EXISTS (SELECT 1 FROM pending_turns p
                                  WHERE p.session_id = v_session AND p.status = 'pending');
        END LOOP;
        CONTINUE WHEN v_turn.id IS NULL;
        SELECT * INTO v_run FROM turnstile_create_runs(
            v_now, ARRAY[v_turn.id], ARRAY[v_turn.tenant_id], ARRAY[v_turn.principal],
            ARRAY[v_session], ARRAY[v_turn.priority], ARRAY[v_turn.agent], ARRAY[v_turn.input],
            ARRAY[v_turn.max_attempts], ARRAY[NULL::timestamptz], ARRAY[NULL::uuid],
            ARRAY[NULL::timestamptz], ARRAY[NULL::uuid], ARRAY[v_turn.traceparent],
            ARRAY[jsonb_build_object('resubmitted_from', NULL, 'by', v_turn.actor,
                                     'pending_turn_id', v_turn.id, 'policy', v_turn.policy,
                                     'after_run_id', v_turn.active_run_id)],
            -- The turn's deadline to start (migration 0027): past already, the run is created
            -- all the same and the expirer ends it `expired`, unclaimed, as any run.
            false, NULL, ARRAY[v_turn.start_before]);
        -- Not created: the session has an active run after all (the index refused it).
        CONTINUE WHEN NOT FOUND;
        UPDATE pending_turns
        SET status = 'started', run_id = v_run.id, updated_at = v_now
        WHERE id = v_turn.id;
        PERFORM pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
            'work', jsonb_build_array(v_run.priority),
            'sessions', jsonb_build_array(left(v_session::text, 8)),
            -- so the expirer wakes for it if it is sooner than the one it waits for
            'start_before', v_run.start_before))::text);
        RETURN NEXT v_run;
    END LOOP;
END
$fn$;
