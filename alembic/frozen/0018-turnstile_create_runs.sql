CREATE OR REPLACE FUNCTION turnstile_create_runs(
    p_now timestamptz,                -- NULL: now()
    p_ids uuid[],
    p_tenants text[],
    p_principals text[],
    p_sessions uuid[],                -- NULL entries: sessionless runs
    p_priorities smallint[],
    p_agents text[],
    p_inputs jsonb[],
    p_max_attempts integer[],
    p_scheduled timestamptz[],        -- NULL entries: eligible from creation
    p_schedule_ids uuid[],            -- a schedule's tick: its schedule and fire time
    p_fire_ats timestamptz[],
    p_resubmitted_from uuid[],
    p_traceparents text[],
    p_created jsonb[],                -- what the run.created event says besides the basics
    p_apply_quota boolean,            -- false: exempt (ticks, deliveries, resubmissions)
    p_max_queued integer,             -- the process default queued quota (NULL: none)
    -- Each run's deadline to start (docs/start-deadlines.md; NULL entries, or no array: none).
    p_start_before timestamptz[] DEFAULT NULL
)
RETURNS SETOF runs
LANGUAGE plpgsql VOLATILE
-- One plan per statement, made once per session and kept: left to the cost-based choice
-- between a custom and a generic plan, these statements were planned again at many calls
-- (an enqueue took 1.06x the release before's with this, 1.17-1.33x without, on a loaded
-- machine; README, "Performance").
SET plan_cache_mode = force_generic_plan
AS $fn$
-- The one way a run comes to be: a turn, POST /runs, a bulk enqueue, a schedule's tick, a
-- webhook delivery, a resubmission. Each new run is written with its run.created event and
-- its first input, and its tenant's count row is marked (turnstile_mark_work), in the
-- caller's transaction; the caller sends the one notification of its statement.
--
-- A run of a session gets its session's next run number; the caller holds the session's
-- row lock, so no other run of the session is being created meanwhile. A run that would break
-- a unique rule (a tick that exists already, a second active run of a session) is not
-- created, and is not returned. With p_max_queued or a tenant_limits override, a tenant whose
-- queued runs would pass its quota is refused whole (TS429 queue-quota, nothing written); the
-- count is bounded by the quota (docs/adr/0009). Concurrent submissions of one tenant may
-- each pass it once. Ticks, webhook deliveries and resubmissions are exempt (p_apply_quota).
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_quota integer;
    v_queued bigint;
    v_tenant text;
    v_adding integer;
BEGIN
    FOR v_tenant, v_adding IN
        SELECT t, count(*) FROM unnest(p_tenants) AS t WHERE p_apply_quota GROUP BY t ORDER BY t
    LOOP
        v_quota := coalesce((SELECT l.max_queued FROM tenant_limits l
                             WHERE l.tenant_id = v_tenant), p_max_queued);
        CONTINUE WHEN v_quota IS NULL;
        SELECT count(*) INTO v_queued FROM (
            SELECT 1 FROM runs q WHERE q.tenant_id = v_tenant AND q.status = 'queued'
            LIMIT v_quota) AS counted;
        IF v_queued + v_adding > v_quota THEN
            RAISE EXCEPTION 'queue-quota' USING ERRCODE = 'TS429',
                DETAIL = jsonb_build_object('tenant_id', v_tenant, 'max_queued', v_quota,
                                            'queued', v_queued)::text;
        END IF;
    END LOOP;

    RETURN QUERY
    WITH spec AS (
        SELECT * FROM unnest(p_ids, p_tenants, p_principals, p_sessions, p_priorities,
                             p_agents, p_inputs, p_max_attempts, p_scheduled, p_schedule_ids,
                             p_fire_ats, p_resubmitted_from, p_traceparents, p_created,
                             coalesce(p_start_before, '{}'))
            AS s(id, tenant_id, principal, session_id, priority, agent, input, max_attempts,
                 scheduled_for, schedule_id, fire_at, resubmitted_from, traceparent, created,
                 start_before)
    ),
    created AS (
        INSERT INTO runs AS r (id, tenant_id, principal, session_id, session_run_no, status,
                               priority, agent, input, max_attempts, scheduled_for,
                               schedule_id, fire_at, last_event_seq, inputs_count,
                               resubmitted_from, traceparent, start_before, created_at,
                               updated_at)
        SELECT s.id, s.tenant_id, s.principal, s.session_id,
               CASE WHEN s.session_id IS NOT NULL THEN
                   (SELECT coalesce(max(n.session_run_no), 0) + 1 FROM runs n
                    WHERE n.session_id = s.session_id)
               END,
               'queued', s.priority, s.agent, s.input, s.max_attempts, s.scheduled_for,
               s.schedule_id, s.fire_at, 1, 1, s.resubmitted_from, s.traceparent,
               s.start_before, v_now, v_now
        FROM spec s
        -- One run per tick (uq_runs_schedule_tick), one active run per session
        -- (uq_runs_session_id_active): what exists already is left alone.
        ON CONFLICT DO NOTHING
        RETURNING r.*
    ),
    event AS (
        INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
        SELECT c.id, 1, 'run.created', 0,
               jsonb_build_object('priority', c.priority, 'agent', c.agent,
                                  'principal', c.principal, 'scheduled_for', c.scheduled_for)
               || CASE WHEN c.start_before IS NOT NULL
                       THEN jsonb_build_object('start_before', c.start_before)
                       ELSE '{}'::jsonb END
               || coalesce(s.created, '{}'::jsonb),
               c.created_at
        FROM created c JOIN spec s ON s.id = c.id
    ),
    first_input AS (
        INSERT INTO run_inputs (run_id, idx, input, principal, event_seq, created_at)
        SELECT c.id, 1, c.input, c.principal, 1, c.created_at FROM created c
    )
    SELECT * FROM created;

    -- Each pair's earliest new run, pairs in key order (the order every statement takes the
    -- count rows in). A run that was not created only marks a pair that may have work.
    PERFORM turnstile_mark_work(m.tenant_id, m.band, m.first_at, v_now)
    FROM (SELECT t AS tenant_id, CAST(p / 10 AS smallint) AS band,
                 min(coalesce(w, v_now)) AS first_at
          FROM unnest(p_tenants, p_priorities, p_scheduled) AS k(t, p, w)
          GROUP BY 1, 2 ORDER BY 1, 2) AS m;
END
$fn$;
