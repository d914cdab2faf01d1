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
    -- Fair shares (0011): the tenant's queued quota when its tenant_limits row sets none
    -- (the process default, TURNSTILE_TENANT_MAX_QUEUED; NULL: no quota).
    p_max_queued integer,
    -- [0012 rate limits] the process defaults of the submission rate limit (NULL: none);
    -- the tenant's tenant_limits row overrides either. NULL by default: a process of the
    -- previous release calls without them during a rolling upgrade.
    p_submit_rate double precision DEFAULT NULL,
    p_submit_burst integer DEFAULT NULL,
    OUT outcome text,              -- created, delivered or replayed
    OUT the_run runs,              -- the run created or delivered to (NULL on a replay)
    OUT stored_status integer,     -- on a replay: the stored answer
    OUT stored_body jsonb,
    OUT stored_run_id uuid,
    -- [0012 rate limits] the tenant's submission rate limit, for the RateLimit headers: its
    -- rate (NULL: no limit), its burst, and the tokens left after this submission (a
    -- replay's: as the bucket stands).
    OUT rate_limit double precision,
    OUT rate_burst integer,
    OUT rate_tokens double precision
)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_taken text;
    v_owner text := p_principal;
    v_active runs;
    v_stored idempotency_keys;
    -- Fair shares (0011): the tenant's queued quota and queued total.
    v_quota integer;
    v_queued bigint;
BEGIN
    -- [0012 rate limits] The tenant's limit and its bucket as they stand, without a lock:
    -- a replay answers with them. A tenant with no rate costs one tenant_limits read.
    SELECT a.rate, a.burst, a.tokens INTO rate_limit, rate_burst, rate_tokens
    FROM turnstile_submit_allowance(p_tenant, v_now, p_submit_rate, p_submit_burst) a;

    IF p_key IS NOT NULL THEN
        -- A twin's uncommitted insert makes this wait on the unique index, bounded by its own
        -- lock timeout; the block's savepoint is the price of telling that wait apart from
        -- any later lock timeout.
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        BEGIN
            INSERT INTO idempotency_keys AS k (tenant_id, principal, key, request_hash,
                                               response_status, response_body, created_at,
                                               expires_at)
            VALUES (p_tenant, p_principal, p_key, p_request_hash, 0, '{}'::jsonb, v_now,
                    v_now + make_interval(secs => p_ttl_seconds))
            ON CONFLICT (tenant_id, principal, key) DO UPDATE
            SET request_hash = excluded.request_hash,
                response_status = 0,
                response_body = '{}'::jsonb,
                run_id = NULL,
                created_at = excluded.created_at,
                expires_at = excluded.expires_at
            -- an expired key not pruned yet counts as absent: it is taken over
            WHERE k.expires_at <= v_now
            RETURNING k.key INTO v_taken;
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'idempotency-key-in-flight' USING ERRCODE = 'TS409',
                DETAIL = jsonb_build_object('key', p_key)::text;
        END;
        PERFORM set_config('lock_timeout', p_lock_timeout_ms::text, true);
        IF v_taken IS NULL THEN
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

    -- [0012 rate limits] A token from the tenant's bucket: after the key (a replay spends
    -- none), before the session lock and the run's rows (a refused submission has written
    -- nothing to runs). The upsert refills and spends in one statement and holds the row to
    -- the commit, so concurrent submissions of the tenant, from any process, take turns;
    -- any refusal below rolls the token back with everything else.
    IF rate_limit IS NOT NULL THEN
        -- Short already as read above: spends committed since can only have taken more,
        -- so this is refused without a lock or a write (a flood of refused submissions
        -- neither queues on the row nor leaves dead versions of it).
        IF rate_tokens < 1 THEN
            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',
                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,
                                            'tokens', rate_tokens)::text;
        END IF;
        INSERT INTO submit_buckets AS b (tenant_id, tokens, refilled_at)
        VALUES (p_tenant, rate_burst - 1, v_now)
        ON CONFLICT (tenant_id) DO UPDATE
        SET tokens = least(rate_burst::double precision,
                           b.tokens + rate_limit
                               * greatest(0, extract(epoch FROM v_now - b.refilled_at)
                                                 ::double precision)) - 1,
            -- never backwards: a submission whose clock is behind the bucket's gains
            -- nothing
            refilled_at = greatest(b.refilled_at, v_now)
        RETURNING b.tokens INTO rate_tokens;
        IF rate_tokens < 0 THEN
            -- Less than one token was left: refused, and rolled back with the spend.
            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',
                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,
                                            'tokens', rate_tokens + 1)::text;
        END IF;
    END IF;

    IF p_session IS NOT NULL THEN
        -- Every submission to a session takes its row first, so routing decisions on one
        -- session are made one at a time. The run belongs to the session's owner, whoever
        -- posted the turn.
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
        -- Routing reads the active run with a fresh snapshot (after the lock wait), then acts
        -- on it. A cancel takes the run row alone: one that commits between the read and a
        -- delivery leaves the delivery nothing to update; routing again gives the turn the
        -- new run it should get.
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
            -- The delivery (as runs.sql deliver_input): guarded by the waiting status.
            WITH delivered AS (
                UPDATE runs r
                SET status = 'queued',
                    question = NULL,
                    -- an answer that brings its own trace moves the rest of the run into it
                    traceparent = coalesce(p_traceparent, r.traceparent),
                    inputs_count = r.inputs_count + 1,
                    last_event_seq = r.last_event_seq + 1,
                    updated_at = v_now
                WHERE r.id = v_active.id AND r.status = 'waiting_for_user'
                RETURNING r.*
            ),
            event AS (
                INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
                SELECT d.id, d.last_event_seq, 'run.input_delivered', d.lease_epoch,
                       jsonb_build_object('input_index', d.inputs_count,
                                          'principal', p_principal),
                       v_now
                FROM delivered d
            ),
            answer AS (
                INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
                SELECT d.id, d.inputs_count, p_input, p_principal, d.last_event_seq, v_now
                FROM delivered d
            )
            SELECT * INTO the_run FROM delivered;
            IF FOUND THEN
                PERFORM pg_notify('turnstile', jsonb_build_object(
                    'work', jsonb_build_array(the_run.priority),
                    'runs', jsonb_build_array(left(the_run.id::text, 8)))::text);
                -- Fair shares (0011): the requeued run counts in its tenant's queued
                -- runs (runs.sql's count_moves), its count row locked after the run.
                -- Never refused by the quota: an answer resumes work already admitted.
                -- [0014] The row holds the lock anyway here (rare path): has_work too.
                INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued,
                                                     has_work)
                VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1, true)
                ON CONFLICT (tenant_id, band) DO UPDATE
                SET queued = c.queued + 1, has_work = true;
                -- A count row never goes without its 8 stripes (a waiting run's row
                -- exists with them: this is for a row created just now).
                IF NOT EXISTS (SELECT 1 FROM tenant_queued_stripes s
                               WHERE s.tenant_id = the_run.tenant_id
                                 AND s.band = the_run.priority / 10) THEN
                    INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
                    SELECT the_run.tenant_id, the_run.priority / 10, g, 0
                    FROM generate_series(0, 7) AS g
                    ON CONFLICT (tenant_id, band, stripe) DO NOTHING;
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
        -- A new queued run, its run.created event and its first input (as runs.sql enqueue).
        -- Fair shares (0011): a tenant whose queued runs reached its quota gets no new run.
        -- The total is the sum of its count rows (one per class), read now; concurrent
        -- submissions of the tenant may each pass it once (docs/adr/0006).
        v_quota := coalesce((SELECT l.max_queued FROM tenant_limits l
                             WHERE l.tenant_id = p_tenant), p_max_queued);
        IF v_quota IS NOT NULL THEN
            -- [0014] The total: count rows plus their stripes.
            SELECT coalesce((SELECT sum(c.queued) FROM tenant_class_counts c
                             WHERE c.tenant_id = p_tenant), 0)
                 + coalesce((SELECT sum(s.queued) FROM tenant_queued_stripes s
                             WHERE s.tenant_id = p_tenant), 0)
            INTO v_queued;
            IF v_queued >= v_quota THEN
                RAISE EXCEPTION 'queue-quota' USING ERRCODE = 'TS429',
                    DETAIL = jsonb_build_object('tenant_id', p_tenant,
                                                'max_queued', v_quota,
                                                'queued', v_queued)::text;
            END IF;
        END IF;
        -- ON CONFLICT on the one-active-run-per-session index is the backstop for anything
        -- that got past the routing, without the savepoint a caught unique violation costs.
        WITH created AS (
            INSERT INTO runs AS r (id, tenant_id, principal, session_id, session_run_no,
                                   status, priority, agent, input, max_attempts,
                                   scheduled_for, last_event_seq, inputs_count,
                                   traceparent, created_at, updated_at)
            VALUES (p_run_id, p_tenant, v_owner, p_session,
                    CASE WHEN p_session IS NOT NULL THEN
                        (SELECT coalesce(max(n.session_run_no), 0) + 1 FROM runs n
                         WHERE n.session_id = p_session)
                    END,
                    'queued',
                    coalesce(p_priority, p_default_priority),
                    coalesce(p_agent, p_default_agent), p_input, p_max_attempts,
                    p_scheduled_for, 1, 1, p_traceparent, v_now, v_now)
            ON CONFLICT (session_id) WHERE status IN ('queued', 'running', 'waiting_for_user')
            DO NOTHING
            RETURNING r.*
        ),
        event AS (
            INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
            SELECT c.id, 1, 'run.created', 0,
                   jsonb_build_object('priority', c.priority, 'agent', c.agent,
                                      'principal', c.principal,
                                      'scheduled_for', c.scheduled_for,
                                      'resubmitted_from', c.resubmitted_from,
                                      'by', p_actor),
                   c.created_at
            FROM created c
        ),
        first_input AS (
            INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
            SELECT c.id, 1, c.input, c.principal, 1, c.created_at FROM created c
        )
        SELECT * INTO the_run FROM created;
        IF NOT FOUND THEN
            SELECT * INTO v_active FROM runs
            WHERE session_id = p_session AND status IN ('queued', 'running', 'waiting_for_user');
            RAISE EXCEPTION 'session-busy' USING ERRCODE = 'TS409',
                DETAIL = jsonb_build_object('session_id', p_session,
                                            'active_run_id', v_active.id,
                                            'status', v_active.status)::text;
        END IF;
        -- [0013] The session too, so its streams in every API process look again now.
        PERFORM pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(
            'work', jsonb_build_array(the_run.priority),
            'sessions', CASE WHEN p_session IS NOT NULL
                             THEN jsonb_build_array(left(p_session::text, 8)) END))::text);
        -- Fair shares (0011): the new run counts in its tenant's queued runs (runs.sql's
        -- count_moves), its count row locked after the run.
        -- [0014] On a stripe, never on the count row: concurrent submissions of one
        -- tenant do not serialise (turnstile_add_queued, docs/adr/0006).
        PERFORM turnstile_add_queued(the_run.tenant_id,
                                     CAST(the_run.priority / 10 AS smallint), 1);
        outcome := 'created';
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
