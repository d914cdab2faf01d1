CREATE OR REPLACE FUNCTION turnstile_claim(
    p_owner text,
    p_priorities smallint[],          -- the classes' priorities the caller serves
    p_lease_seconds double precision,
    p_limit integer,                  -- at most this many runs
    p_max_running integer[],          -- process default limits by band (NULL: none)
    p_now timestamptz,                -- NULL: now()
    p_claim uuid                      -- this claim's id, in its run.claimed events (its replay)
)
RETURNS TABLE (run runs, passed_over integer)
LANGUAGE plpgsql VOLATILE AS $fn$
-- The claim (ADR-0004 decision 1, with fair shares between tenants: docs/adr/0006 and 0009).
-- Classes highest first; within a class, tenants in the fair order (fewest running runs of
-- the class, then least recently served), only the pairs with work to claim now (marked, or
-- come due), round robin: every tenant's first run, then every tenant's next, ... Within
-- a tenant, its highest priority, then longest eligible run. A tenant at its concurrency
-- limit for the class is passed over, its webhook deliveries and schedule ticks with its other
-- runs: they are exempt from the queued quota, not from the limit.
-- Runs are taken FOR UPDATE SKIP LOCKED, so contending claimers step over each other.
--
-- The walk reads the count rows' snapshot; the limits are then held exactly against the rows
-- locked in (tenant_id, band) order, after the runs, as every statement locks them. Runs
-- taken beyond a limit a concurrent claim reached first stay queued (`passed_over`; the
-- caller asks again at once). A tenant the walk finds with nothing to claim (its last runs
-- were claimed or cancelled, or its work is all later) is offered to turnstile_settle_work,
-- which takes it out of the walk until it has work again: the walk costs only the tenants
-- with work to claim now, and each emptied one once. Always at least one row: `run` NULL when
-- nothing was claimed.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_band smallint;
    v_priorities smallint[];
    -- The walk: the two cursors, the next pair of each, and the pair being walked.
    v_marked refcursor;
    v_due refcursor;
    m record;
    d record;
    t record;
    v_more_marked boolean;
    v_more_due boolean;
    v_from_due boolean;
    v_cap integer;
    v_head uuid;
    v_take integer;
    -- The runs taken, in order, with their tenant, band and limit.
    v_ids uuid[] := '{}';
    v_tenants text[] := '{}';
    v_bands smallint[] := '{}';
    v_caps integer[] := '{}';
    -- The tenants of the round being walked, and of the next.
    v_round text[];
    v_round_caps integer[];
    v_next text[];
    v_next_caps integer[];
    v_got uuid[];
    -- Pairs to offer to turnstile_settle_work at the end.
    v_idle_tenants text[] := '{}';
    v_idle_bands smallint[] := '{}';
    v_allowed uuid[];
    v_passed integer := 0;
    i integer;
BEGIN
    FOR v_band IN SELECT DISTINCT p / 10 FROM unnest(p_priorities) AS p ORDER BY 1 LOOP
        EXIT WHEN cardinality(v_ids) >= p_limit;
        v_priorities := ARRAY(SELECT p FROM unnest(p_priorities) AS p WHERE p / 10 = v_band
                              ORDER BY p);
        -- Round 1: the fair order, one run from each tenant that has one to claim now,
        -- walked only as far as it takes (a claim of one run reads the first pairs, not all
        -- of them): the pairs marked as having work, in ix_tenant_class_counts_fair's order,
        -- merged with the few whose work has come due since they were settled
        -- (ix_tenant_class_counts_due, sorted). Two cursors, since PostgreSQL plans a UNION
        -- ALL of the two as a sort of every marked pair before the first row.
        v_round := '{}'; v_round_caps := '{}';
        OPEN v_marked FOR
            SELECT c.tenant_id, c.running, c.last_claimed_at FROM tenant_class_counts c
            WHERE c.band = v_band AND c.has_work
            ORDER BY c.running, c.last_claimed_at NULLS FIRST, c.tenant_id;
        OPEN v_due FOR
            SELECT c.tenant_id, c.running, c.last_claimed_at FROM tenant_class_counts c
            WHERE c.band = v_band AND NOT c.has_work AND c.due_at <= v_now
            ORDER BY c.running, c.last_claimed_at NULLS FIRST, c.tenant_id;
        FETCH v_marked INTO m;
        v_more_marked := FOUND;
        FETCH v_due INTO d;
        v_more_due := FOUND;
        WHILE v_more_marked OR v_more_due LOOP
            -- The next pair in the fair order (fewest running, never served first, then least
            -- recently served, then the tenant's name).
            IF v_more_marked AND (NOT v_more_due
                    OR m.running < d.running
                    OR (m.running = d.running
                        AND (m.last_claimed_at IS NULL AND d.last_claimed_at IS NOT NULL
                             OR m.last_claimed_at < d.last_claimed_at
                             OR (m.last_claimed_at IS NOT DISTINCT FROM d.last_claimed_at
                                 AND m.tenant_id <= d.tenant_id)))) THEN
                t := m;
                v_from_due := false;
                FETCH v_marked INTO m;
                v_more_marked := FOUND;
            ELSE
                t := d;
                v_from_due := true;
                FETCH v_due INTO d;
                v_more_due := FOUND;
            END IF;
            -- Its limit for the class: its own, else the process's default.
            v_cap := NULL;
            SELECT CAST(l.max_running ->> (ARRAY['interactive', 'async', 'maintenance'])
                                               [v_band + 1] AS integer)
            INTO v_cap FROM tenant_limits l WHERE l.tenant_id = t.tenant_id;
            v_cap := coalesce(v_cap, p_max_running[v_band + 1]);
            CONTINUE WHEN v_cap IS NOT NULL AND t.running >= v_cap;  -- at its limit
            -- Its head: its highest priority, then its longest eligible run, each priority one
            -- bounded range of ix_runs_tenant_claim, as turnstile_claim_heads reads them, in
            -- this statement rather than a call (a call per tenant cost most of a claim).
            v_head := NULL;
            SELECT h.id INTO v_head FROM unnest(v_priorities) AS p(priority)
            CROSS JOIN LATERAL (
                SELECT q.id FROM runs q
                WHERE q.tenant_id = t.tenant_id AND q.status = 'queued'
                  AND q.priority = p.priority
                  AND coalesce(q.scheduled_for, q.created_at) <= v_now
                  AND (q.start_before IS NULL OR q.start_before > v_now
                       OR q.started_at IS NOT NULL)
                  -- The cursors read two snapshots: a pair marked between them is in both,
                  -- and this claim's own locks do not skip the run it took the first time.
                  AND (NOT v_from_due OR q.id <> ALL(v_ids))
                ORDER BY coalesce(q.scheduled_for, q.created_at)
                LIMIT 1
                FOR UPDATE SKIP LOCKED) AS h
            LIMIT 1;
            IF v_head IS NULL THEN
                v_idle_tenants := v_idle_tenants || t.tenant_id;
                v_idle_bands := v_idle_bands || v_band;
                CONTINUE;
            END IF;
            v_ids := v_ids || v_head;
            v_tenants := v_tenants || t.tenant_id;
            v_bands := v_bands || v_band;
            v_caps := v_caps || v_cap;
            v_round := v_round || t.tenant_id;
            v_round_caps := v_round_caps || v_cap;
            EXIT WHEN cardinality(v_ids) >= p_limit;
        END LOOP;
        CLOSE v_marked;
        CLOSE v_due;
        -- Further rounds: the tenants that had a run, in the same order, a share each of
        -- what is left (one statement per tenant and round, whatever the share).
        WHILE cardinality(v_ids) < p_limit AND cardinality(v_round) > 0 LOOP
            v_take := ceil((p_limit - cardinality(v_ids))::numeric / cardinality(v_round));
            v_next := '{}'; v_next_caps := '{}';
            FOR i IN 1 .. cardinality(v_round) LOOP
                EXIT WHEN cardinality(v_ids) >= p_limit;
                v_got := ARRAY(SELECT h FROM turnstile_claim_heads(
                                   v_round[i], v_priorities, v_now,
                                   least(v_take, p_limit - cardinality(v_ids)), v_ids) AS h);
                CONTINUE WHEN cardinality(v_got) = 0;
                v_ids := v_ids || v_got;
                v_tenants := v_tenants || array_fill(v_round[i], ARRAY[cardinality(v_got)]);
                v_bands := v_bands || array_fill(v_band, ARRAY[cardinality(v_got)]);
                v_caps := v_caps || array_fill(v_round_caps[i], ARRAY[cardinality(v_got)]);
                IF cardinality(v_got) = v_take THEN  -- it may have more
                    v_next := v_next || v_round[i];
                    v_next_caps := v_next_caps || v_round_caps[i];
                END IF;
            END LOOP;
            v_round := v_next; v_round_caps := v_next_caps;
        END LOOP;
    END LOOP;

    IF cardinality(v_ids) > 0 THEN
        -- The limits, exactly: the count rows locked in key order (after the runs), each
        -- tenant's taken runs ranked against the room its row shows now.
        WITH taken AS (
            SELECT * FROM unnest(v_ids, v_tenants, v_bands, v_caps)
                WITH ORDINALITY AS k(id, tenant_id, band, cap, ord)
        ),
        counts AS MATERIALIZED (
            SELECT c.tenant_id, c.band, c.running FROM tenant_class_counts c
            WHERE c.tenant_id = ANY(ARRAY(SELECT DISTINCT tenant_id FROM taken))
              AND (c.tenant_id, c.band) IN (SELECT tenant_id, band FROM taken)
            ORDER BY c.tenant_id, c.band
            FOR UPDATE
        ),
        ranked AS (
            SELECT taken.*, row_number() OVER (PARTITION BY tenant_id, band
                                               ORDER BY ord) AS rank
            FROM taken
        )
        SELECT ARRAY(SELECT r.id FROM ranked r
                     JOIN counts c ON c.tenant_id = r.tenant_id AND c.band = r.band
                     WHERE r.cap IS NULL OR c.running + r.rank <= r.cap)
        INTO v_allowed;
        v_passed := cardinality(v_ids) - cardinality(v_allowed);

        RETURN QUERY
        WITH claimed AS (
            UPDATE runs r
            SET status = 'running',
                lease_epoch = r.lease_epoch + 1,        -- the fencing token of this claim
                attempts = r.attempts + 1,
                lease_owner = p_owner,
                lease_expires_at = v_now + make_interval(secs => p_lease_seconds),
                last_event_seq = r.last_event_seq + 1,
                started_at = coalesce(r.started_at, v_now),
                updated_at = v_now
            -- By primary key alone: the runs are locked and still queued.
            WHERE r.id = ANY(v_allowed)
            RETURNING r.*
        ),
        event AS (
            INSERT INTO run_events (run_id, seq, type, epoch, data, created_at)
            SELECT c.id, c.last_event_seq, 'run.claimed', c.lease_epoch,
                   jsonb_build_object('attempt', c.attempts, 'owner', c.lease_owner,
                                      'lease_expires_at', c.lease_expires_at,
                                      'claim', p_claim),
                   v_now
            FROM claimed c
        ),
        counted AS (
            -- The rows locked above. last_claimed_at orders ties between tenants: the wall
            -- clock (a serving order, not a run's time), so it advances under a test's clock.
            UPDATE tenant_class_counts c
            SET running = c.running + n.n, last_claimed_at = clock_timestamp()
            FROM (SELECT tenant_id, priority / 10 AS band, count(*) AS n FROM claimed
                  GROUP BY 1, 2) AS n
            WHERE c.tenant_id = n.tenant_id AND c.band = n.band
        )
        SELECT ROW(c.*)::runs, v_passed FROM claimed c;
    END IF;

    -- Last, so that nothing waits while holding what these take (they never wait).
    PERFORM turnstile_settle_work(k.tenant_id, k.band, v_now)
    FROM unnest(v_idle_tenants, v_idle_bands) AS k(tenant_id, band)
    ORDER BY k.tenant_id, k.band;

    IF cardinality(v_ids) = 0 OR cardinality(v_allowed) = 0 THEN
        RETURN QUERY SELECT NULL::runs, v_passed;
    END IF;
END
$fn$;
