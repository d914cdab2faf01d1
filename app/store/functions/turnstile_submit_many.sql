CREATE OR REPLACE FUNCTION turnstile_submit_many(
    p_now timestamptz,
    -- One element per submission, in the order the API process received them; each is what
    -- the same-named argument of turnstile_submit is for one submission.
    p_tenants text[],
    p_principals text[],
    p_own_sessions_only boolean[],
    p_actors text[],
    p_sessions uuid[],
    p_keys text[],
    p_request_hashes text[],
    p_run_ids uuid[],
    p_agents text[],
    p_priorities smallint[],
    p_default_priorities smallint[],
    p_scheduled_fors timestamptz[],
    p_inputs jsonb[],
    p_traceparents text[],
    p_start_withins double precision[],
    p_start_befores timestamptz[],
    p_approvals jsonb[],
    -- The process's settings, the same for every submission of the batch.
    p_ttl_seconds double precision,
    p_wait_ms integer,
    p_lock_timeout_ms integer,
    p_default_agent text,
    p_max_attempts integer,
    p_max_queued integer,
    p_submit_rate double precision,
    p_submit_burst integer
)
-- One row per submission, in the order given: `refusal` NULL and turnstile_submit's outputs,
-- or the refusal's name (its message), SQLSTATE and fields, with the tenant's allowance as it
-- stands (for the RateLimit headers, as the single path reads it after a refusal).
RETURNS TABLE (
    item integer,
    refusal text,
    refusal_code text,
    refusal_detail jsonb,
    outcome text,
    the_run runs,
    stored_status integer,
    stored_body jsonb,
    stored_run_id uuid,
    rate_limit double precision,
    rate_burst integer,
    rate_tokens double precision
)
LANGUAGE plpgsql VOLATILE AS $fn$
-- Group-committed submissions (docs/adr/0012-group-committed-submissions.md): the turns and
-- sessionless runs one API process received together, in one transaction, one commit and one
-- notification. Each is turnstile_submit itself, unchanged, inside a block of its own: a
-- refusal (a busy session, a rate limit, a quota, a reused key) rolls back that block's
-- savepoint only, so it writes nothing and its neighbours keep what they wrote. Any other
-- error (a lock timeout, a deadlock) fails the whole call, which the caller then sends again
-- one submission at a time.
-- The caller bounds the batch (app/queue/submit_batches.py, MAX_BATCH): each block is a
-- subtransaction, and a backend caches 64 subtransaction ids before every snapshot taken
-- elsewhere has to look them up in pg_subtrans.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_one record;
    v_detail text;
    -- The one notification: the classes given work, the runs answered, the sessions given a
    -- run, and the soonest deadline to start (docs/start-deadlines.md).
    v_work smallint[] := '{}';
    v_runs text[] := '{}';
    v_named_sessions text[] := '{}';
    v_start_before timestamptz;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_run_ids), 0) LOOP
        item := i;
        refusal := NULL;
        refusal_code := NULL;
        refusal_detail := NULL;
        BEGIN
            SELECT * INTO v_one
            FROM turnstile_submit(
                p_now => v_now, p_tenant => p_tenants[i], p_principal => p_principals[i],
                p_own_sessions_only => p_own_sessions_only[i], p_actor => p_actors[i],
                p_session => p_sessions[i], p_key => p_keys[i],
                p_request_hash => p_request_hashes[i], p_ttl_seconds => p_ttl_seconds,
                p_wait_ms => p_wait_ms, p_lock_timeout_ms => p_lock_timeout_ms,
                p_run_id => p_run_ids[i], p_agent => p_agents[i],
                p_default_agent => p_default_agent, p_priority => p_priorities[i],
                p_default_priority => p_default_priorities[i],
                p_scheduled_for => p_scheduled_fors[i], p_input => p_inputs[i],
                p_max_attempts => p_max_attempts, p_traceparent => p_traceparents[i],
                p_max_queued => p_max_queued, p_submit_rate => p_submit_rate,
                p_submit_burst => p_submit_burst, p_start_within => p_start_withins[i],
                p_start_before => p_start_befores[i], p_approval => p_approvals[i],
                p_notify => false);
            outcome := v_one.outcome;
            the_run := v_one.the_run;
            stored_status := v_one.stored_status;
            stored_body := v_one.stored_body;
            stored_run_id := v_one.stored_run_id;
            rate_limit := v_one.rate_limit;
            rate_burst := v_one.rate_burst;
            rate_tokens := v_one.rate_tokens;
        EXCEPTION WHEN SQLSTATE 'TS404' OR SQLSTATE 'TS409' OR SQLSTATE 'TS422'
                       OR SQLSTATE 'TS429' THEN
            GET STACKED DIAGNOSTICS refusal = MESSAGE_TEXT, refusal_code = RETURNED_SQLSTATE,
                                    v_detail = PG_EXCEPTION_DETAIL;
            refusal_detail := coalesce(nullif(v_detail, ''), '{}')::jsonb;
            outcome := NULL;
            the_run := NULL;
            stored_status := NULL;
            stored_body := NULL;
            stored_run_id := NULL;
            -- The bucket after the block's rollback: a token this submission took is back.
            SELECT a.rate, a.burst, a.tokens INTO rate_limit, rate_burst, rate_tokens
            FROM turnstile_submit_allowance(p_tenants[i], v_now, p_submit_rate,
                                            p_submit_burst) a;
        END;
        IF outcome = 'created' THEN
            v_work := v_work || the_run.priority;
            IF the_run.session_id IS NOT NULL THEN
                v_named_sessions := v_named_sessions || left(the_run.session_id::text, 8);
            END IF;
            -- least ignores a NULL: the soonest of the deadlines given.
            v_start_before := least(v_start_before, the_run.start_before);
        ELSIF outcome = 'delivered' THEN
            v_work := v_work || the_run.priority;
            v_runs := v_runs || left(the_run.id::text, 8);
        END IF;
        RETURN NEXT;
    END LOOP;

    IF cardinality(v_work) > 0 THEN
        -- Bounded by the batch's bound: at most MAX_BATCH run and session prefixes.
        PERFORM pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
            'work', (SELECT jsonb_agg(DISTINCT w) FROM unnest(v_work) w),
            'runs', CASE WHEN cardinality(v_runs) > 0 THEN to_jsonb(v_runs) END,
            'sessions', CASE WHEN cardinality(v_named_sessions) > 0
                             THEN to_jsonb(v_named_sessions) END,
            'start_before', v_start_before))::text);
    END IF;
END;
$fn$;
