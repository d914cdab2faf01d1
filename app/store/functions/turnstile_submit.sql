CREATE OR REPLACE FUNCTION turnstile_submit(
    p_now timestamptz,
    p_tenant text,
    p_principal text,              -- the submitting key's principal
    p_own_sessions_only boolean,   -- a key without a scope: only its principal's sessions
    p_actor text,                  -- the key that submitted (recorded as `by` in run.created)
    p_session uuid,                -- NULL: a sessionless run
    p_key text,                    -- NULL: no Idempotency-Key
    p_request_hash text,
    p_ttl_seconds double precision,
    p_wait_ms integer,             -- how long to wait for a twin holding the same key
    p_lock_timeout_ms integer,     -- the lock timeout for everything after the key
    p_run_id uuid,
    p_agent text,                  -- NULL: the client left it out
    p_default_agent text,
    p_priority smallint,           -- NULL: the client left the class out
    p_default_priority smallint,
    p_scheduled_for timestamptz,
    p_input jsonb,
    p_max_attempts integer,
    p_traceparent text,            -- the W3C trace context the run's work continues (or NULL)
    -- The tenant's queued quota when its tenant_limits row sets none (the process default,
    -- TURNSTILE_TENANT_MAX_QUEUED; NULL: no quota).
    p_max_queued integer,
    -- The process defaults of the submission rate limit (NULL: none); the tenant's
    -- tenant_limits row overrides either.
    p_submit_rate double precision DEFAULT NULL,
    p_submit_burst integer DEFAULT NULL,
    -- A new run's deadline to start (docs/start-deadlines.md): seconds after it becomes
    -- eligible, or a time; NULL both: none. An answer to a waiting run ignores them (it has
    -- started already).
    p_start_within double precision DEFAULT NULL,
    p_start_before timestamptz DEFAULT NULL,
    -- The turn's approval policy (docs/approvals.md, migration 0025): kept on the run it
    -- creates or answers; NULL: the run keeps its own (its session's, else the default).
    p_approval jsonb DEFAULT NULL,
    -- false: send no notification; the caller sends one for its whole batch
    -- (turnstile_submit_many, migration 0026).
    p_notify boolean DEFAULT true,
    OUT outcome text,              -- created, delivered or replayed
    OUT the_run runs,              -- the run created or delivered to (NULL on a replay)
    OUT stored_status integer,     -- on a replay: the stored answer
    OUT stored_body jsonb,
    OUT stored_run_id uuid,
    -- The tenant's submission rate limit, for the RateLimit headers: its
    -- rate (NULL: no limit), its burst, and the tokens left after this submission (a
    -- replay's: as the bucket stands).
    OUT rate_limit double precision,
    OUT rate_burst integer,
    OUT rate_tokens double precision
)
LANGUAGE plpgsql VOLATILE AS $fn$
-- A turn or a sessionless run in one round trip (ADR-0004's routing; docs/architecture.md,
-- "One turn, end to end"). Each step is a statement with a snapshot of its own:
-- 1. the tenant's rate limit and bucket as they stand (a replay answers with them);
-- 2. with an Idempotency-Key, the key (turnstile_claim_key): a twin in flight is waited for
--    within p_wait_ms, then its stored answer replayed, spending nothing;
-- 3. with a rate limit, a token from the tenant's bucket, held to the commit (none left:
--    TS429 rate-limited, before any run is written);
-- 4. for a turn, the session's row locked (the routing decisions of one session are made one
--    at a time) and its last activity marked; then, on a fresh read of its active run: none,
--    a new run; a run waiting for the user, the answer delivered to it (turnstile_deliver_input;
--    routed again if a cancel got there first); a run queued or running, TS409 session-busy;
--    a run waiting for a tool call's approval, TS409 approval-pending (only an approval,
--    app/queue/approvals.py, answers it);
-- 5. a new run through turnstile_create_runs (the queued quota: TS429 queue-quota);
-- 6. the 2xx answer stored under the key.
-- Refusals raise SQLSTATE TS404/TS409/TS422/TS429 with the problem's name as the message and
-- its fields as JSON in the detail; the transaction then rolls back whole, the key included.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_taken boolean;
    v_owner text := p_principal;
    v_active runs;
    v_stored idempotency_keys;
    -- start_within counts from when the run becomes eligible: scheduled_for, or now when
    -- that is later (greatest ignores a NULL).
    v_start_before timestamptz := coalesce(
        p_start_before,
        greatest(p_scheduled_for, v_now) + make_interval(secs => p_start_within));
BEGIN
    SELECT a.rate, a.burst, a.tokens INTO rate_limit, rate_burst, rate_tokens
    FROM turnstile_submit_allowance(p_tenant, v_now, p_submit_rate, p_submit_burst) a;

    IF p_key IS NOT NULL THEN
        -- The wait on a twin's key is bounded by its own lock timeout; the block's savepoint
        -- is the price of telling that wait apart from any later lock timeout.
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        BEGIN
            v_taken := turnstile_claim_key(v_now, p_tenant, p_principal, p_key,
                                           p_request_hash, p_ttl_seconds);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'idempotency-key-in-flight' USING ERRCODE = 'TS409',
                DETAIL = jsonb_build_object('key', p_key)::text;
        END;
        PERFORM set_config('lock_timeout', p_lock_timeout_ms::text, true);
        IF NOT v_taken THEN
            -- A new statement, a new snapshot: it sees the twin's committed answer.
            SELECT * INTO v_stored FROM idempotency_keys
            WHERE tenant_id = p_tenant AND principal = p_principal AND key = p_key;
            IF v_stored.request_hash <> p_request_hash THEN
                RAISE EXCEPTION 'idempotency-key-reused' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('key', p_key)::text;
            END IF;
            outcome := 'replayed';
            stored_status := v_stored.response_status;
            stored_body := v_stored.response_body;
            stored_run_id := v_stored.run_id;
            RETURN;
        END IF;
    END IF;

    IF rate_limit IS NOT NULL THEN
        -- Short already as read above: spends committed since can only have taken more, so
        -- this is refused without a lock or a write (a flood of refused submissions neither
        -- queues on the row nor leaves dead versions of it).
        IF rate_tokens < 1 THEN
            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',
                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,
                                            'tokens', rate_tokens)::text;
        END IF;
        -- Refill and spend in one statement, holding the row to the commit: concurrent
        -- submissions of the tenant, from any process, take turns; a refusal below rolls
        -- the token back with everything else.
        INSERT INTO submit_buckets AS b (tenant_id, tokens, refilled_at)
        VALUES (p_tenant, rate_burst - 1, v_now)
        ON CONFLICT (tenant_id) DO UPDATE
        SET tokens = least(rate_burst::double precision,
                           b.tokens + rate_limit
                               * greatest(0, extract(epoch FROM v_now - b.refilled_at)
                                                 ::double precision)) - 1,
            -- never backwards: a submission whose clock is behind the bucket's gains nothing
            refilled_at = greatest(b.refilled_at, v_now)
        RETURNING b.tokens INTO rate_tokens;
        IF rate_tokens < 0 THEN
            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',
                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,
                                            'tokens', rate_tokens + 1)::text;
        END IF;
    END IF;

    IF p_session IS NOT NULL THEN
        -- The run belongs to the session's owner, whoever posted the turn.
        SELECT s.principal INTO v_owner FROM sessions s
        WHERE s.id = p_session AND s.tenant_id = p_tenant
          AND (NOT p_own_sessions_only OR s.principal = p_principal)
        FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'session-not-found' USING ERRCODE = 'TS404',
                DETAIL = jsonb_build_object('session_id', p_session)::text;
        END IF;
        -- The session's last activity (session retention reads it), under this lock.
        UPDATE sessions SET last_activity_at = greatest(last_activity_at, v_now)
        WHERE id = p_session;
        -- A cancel takes the run row alone: one that commits between the read and a delivery
        -- leaves the delivery nothing to update; routing again gives the turn a new run.
        FOR attempt IN 1..2 LOOP
            SELECT * INTO v_active FROM runs
            WHERE session_id = p_session AND status IN ('queued', 'running', 'waiting_for_user');
            EXIT WHEN NOT FOUND;
            IF v_active.status <> 'waiting_for_user' THEN
                RAISE EXCEPTION 'session-busy' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('session_id', p_session,
                                                'active_run_id', v_active.id,
                                                'status', v_active.status)::text;
            END IF;
            -- A run waiting for an approval takes only an approval (docs/approvals.md).
            IF v_active.question -> 'approval_request' IS NOT NULL THEN
                RAISE EXCEPTION 'approval-pending' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object(
                        'session_id', p_session, 'run_id', v_active.id,
                        'call_id', v_active.question -> 'approval_request' ->> 'call_id',
                        'tool', v_active.question -> 'approval_request' ->> 'tool')::text;
            END IF;
            -- An answer resumes the waiting run: the fields it sets must match the run's.
            IF p_agent IS NOT NULL AND p_agent <> v_active.agent THEN
                RAISE EXCEPTION 'answer-conflict' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('field', 'agent', 'run_value', v_active.agent,
                                                'given', p_agent)::text;
            END IF;
            IF p_priority IS NOT NULL AND p_priority / 10 <> v_active.priority / 10 THEN
                RAISE EXCEPTION 'answer-conflict' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('field', 'priority',
                                                'run_priority', v_active.priority,
                                                'given_priority', p_priority)::text;
            END IF;
            IF p_scheduled_for IS NOT NULL
               AND p_scheduled_for IS DISTINCT FROM v_active.scheduled_for THEN
                RAISE EXCEPTION 'answer-conflict' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('field', 'scheduled_for',
                                                'run_value', v_active.scheduled_for,
                                                'given', p_scheduled_for)::text;
            END IF;
            -- Never refused by the quota: an answer resumes work already admitted.
            SELECT * INTO the_run
            FROM turnstile_deliver_input(v_now, v_active.id, p_input, p_principal,
                                         p_traceparent);
            IF FOUND THEN
                IF p_notify THEN
                    PERFORM pg_notify('turnstile', jsonb_build_object(
                        'work', jsonb_build_array(the_run.priority),
                        'runs', jsonb_build_array(left(the_run.id::text, 8)))::text);
                END IF;
                outcome := 'delivered';
                EXIT;
            END IF;
            IF attempt = 2 THEN
                RAISE EXCEPTION 'run-not-waiting' USING ERRCODE = 'TS409',
                    DETAIL = jsonb_build_object('run_id', v_active.id)::text;
            END IF;
        END LOOP;
    END IF;

    IF outcome IS NULL THEN
        -- A deadline to start long past is the client's mistake (a few seconds are a clock's
        -- skew: app/vocabulary/deadlines.py, START_BEFORE_TOLERANCE_SECONDS). Checked here,
        -- after the key: a retry of a submission that was accepted replays it, however late.
        IF p_start_before < v_now - interval '5 seconds' THEN
            RAISE EXCEPTION 'start-deadline-passed' USING ERRCODE = 'TS422',
                DETAIL = jsonb_build_object('start_before', p_start_before, 'now', v_now)::text;
        END IF;
        SELECT * INTO the_run
        FROM turnstile_create_runs(
            v_now, ARRAY[p_run_id], ARRAY[p_tenant], ARRAY[v_owner], ARRAY[p_session],
            ARRAY[coalesce(p_priority, p_default_priority)],
            ARRAY[coalesce(p_agent, p_default_agent)], ARRAY[p_input], ARRAY[p_max_attempts],
            ARRAY[p_scheduled_for], ARRAY[NULL::uuid], ARRAY[NULL::timestamptz],
            ARRAY[NULL::uuid], ARRAY[p_traceparent],
            ARRAY[jsonb_build_object('resubmitted_from', NULL, 'by', p_actor)],
            true, p_max_queued, ARRAY[v_start_before]);
        IF NOT FOUND THEN
            -- The one-active-run index refused it: something got past the routing.
            SELECT * INTO v_active FROM runs
            WHERE session_id = p_session AND status IN ('queued', 'running', 'waiting_for_user');
            RAISE EXCEPTION 'session-busy' USING ERRCODE = 'TS409',
                DETAIL = jsonb_build_object('session_id', p_session,
                                            'active_run_id', v_active.id,
                                            'status', v_active.status)::text;
        END IF;
        -- The session too, so its streams in every API process look again now; and its
        -- deadline to start, so the expirer wakes for it if it is sooner than the one it
        -- waits for.
        IF p_notify THEN
            PERFORM pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
                'work', jsonb_build_array(the_run.priority),
                'sessions', CASE WHEN p_session IS NOT NULL
                                 THEN jsonb_build_array(left(p_session::text, 8)) END,
                'start_before', the_run.start_before))::text);
        END IF;
        outcome := 'created';
    END IF;

    IF p_approval IS NOT NULL THEN
        -- The turn's approval policy, on the run it created or answered, before the commit
        -- that lets a worker claim it.
        UPDATE runs SET approval = p_approval WHERE id = the_run.id RETURNING * INTO the_run;
    END IF;

    IF p_key IS NOT NULL THEN
        -- Only 2xx outcomes get here. The answer is kept as the run row it was rendered from.
        UPDATE idempotency_keys
        SET response_status = 202, response_body = jsonb_build_object('run', to_jsonb(the_run)),
            run_id = the_run.id
        WHERE tenant_id = p_tenant AND principal = p_principal AND key = p_key;
    END IF;
END;
$fn$;
