CREATE OR REPLACE FUNCTION turnstile_settle_work(
    p_tenant text,
    p_band smallint,
    p_now timestamptz         -- NULL: now()
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
-- Takes (p_tenant, p_band) out of the fair walk when it has no run to claim now: has_work
-- false, and due_at the earliest eligibility time of its queued runs (NULL: none), from
-- which the walk takes it in again. True when it did. Called by the claims for the tenants they drained
-- or passed, by the statements that take runs out of queued, and by the settler service.
--
-- It never waits, so any statement may call it whatever it holds. It gives up when an
-- enqueue of the pair is in flight (the advisory lock turnstile_mark_work holds shared), and
-- when another transaction holds the count row (a transition requeueing a run sets has_work
-- in its own update of the row, after this commits). Holding both, it reads the queue on a
-- snapshot of its own, taken after both locks: nothing can add eligible work to the pair
-- until it commits, and everything committed before is seen.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_first timestamptz;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1953724267, hashtext(p_tenant || '/' || p_band)) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM tenant_class_counts
    WHERE tenant_id = p_tenant AND band = p_band
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- The head of each priority of the band (ix_runs_tenant_claim), the earliest of them.
    SELECT min(h.at) INTO v_first
    FROM generate_series(p_band * 10, p_band * 10 + 9) AS p(priority)
    CROSS JOIN LATERAL (
        SELECT coalesce(w.scheduled_for, w.created_at) AS at FROM runs w
        WHERE w.tenant_id = p_tenant AND w.status = 'queued' AND w.priority = p.priority
        ORDER BY coalesce(w.scheduled_for, w.created_at)
        LIMIT 1
    ) AS h;
    IF v_first <= v_now THEN
        RETURN false;  -- work to claim now (runs other claims hold are still queued here)
    END IF;
    UPDATE tenant_class_counts SET has_work = false, due_at = v_first
    WHERE tenant_id = p_tenant AND band = p_band
      AND (has_work OR due_at IS DISTINCT FROM v_first);
    RETURN FOUND;
END
$fn$;
