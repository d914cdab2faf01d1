CREATE OR REPLACE FUNCTION turnstile_mark_work(
    p_tenant text,
    p_band smallint,
    p_first_at timestamptz,   -- the earliest eligibility time of the new queued runs
    p_now timestamptz         -- NULL: now()
)
RETURNS void
LANGUAGE plpgsql VOLATILE
-- One plan per statement, made once per session and kept: left to the cost-based choice
-- between a custom and a generic plan, these statements were planned again at many calls
-- (an enqueue took 1.06x the release before's with this, 1.17-1.33x without, on a loaded
-- machine; README, "Performance").
SET plan_cache_mode = force_generic_plan
AS $fn$
-- New queued runs of (p_tenant, p_band), written by the caller's transaction without holding
-- the pair's count row: runs the fair walk must find (docs/adr/0009). Eligible now, the row
-- gets has_work; eligible later, its due_at comes no later than p_first_at, and the claims'
-- walk takes the pair in again from then on.
--
-- Only turnstile_settle_work ever clears has_work or raises due_at, and only while it holds
-- the pair's advisory lock exclusively. This holds it shared (enqueues of one tenant never
-- wait for each other), so a settle in flight is waited for and none starts until the
-- caller's transaction ends; the marks below are statements of their own, on a snapshot taken
-- after the lock, and so see whatever a settle before them wrote. Each writes only when the
-- row is not marked already: the common enqueue reads the row and writes nothing.
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    -- A first run of the pair: its count row, in the caller's transaction.
    INSERT INTO tenant_class_counts (tenant_id, band, running, queued, has_work)
    VALUES (p_tenant, p_band, 0, 0, false)
    ON CONFLICT (tenant_id, band) DO NOTHING;
    -- The key: a namespace of ours ('work'), then the pair; a rare collision of two pairs only
    -- makes a settle give up once.
    PERFORM pg_advisory_xact_lock_shared(1953724267, hashtext(p_tenant || '/' || p_band));
    IF p_first_at <= v_now THEN
        UPDATE tenant_class_counts SET has_work = true, due_at = NULL
        WHERE tenant_id = p_tenant AND band = p_band AND NOT has_work;
    ELSE
        UPDATE tenant_class_counts SET due_at = p_first_at
        WHERE tenant_id = p_tenant AND band = p_band AND NOT has_work
          AND (due_at IS NULL OR due_at > p_first_at);
    END IF;
END
$fn$;
