CREATE OR REPLACE FUNCTION turnstile_clear_work(p_tenant text, p_band smallint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
-- Clears has_work of (p_tenant, p_band) when it provably has no queued run. Never waits: the
-- count row and the stripes are taken SKIP LOCKED, the row first (a caller that changed it
-- already holds it), then the stripes in order. It clears only when it holds all 8 stripes
-- and the exact total is 0: an enqueue in flight holds its stripe (so nothing is cleared
-- under it), and an enqueue that comes after waits on the stripe held here, then marks on a
-- fresh snapshot (turnstile_add_queued).
-- True when it cleared.
DECLARE
    v_queued bigint;
    v_stripes integer;
    v_striped bigint;
BEGIN
    SELECT c.queued INTO v_queued FROM tenant_class_counts c
    WHERE c.tenant_id = p_tenant AND c.band = p_band AND c.has_work
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT count(*), coalesce(sum(s.queued), 0) INTO v_stripes, v_striped
    FROM (SELECT s.queued FROM tenant_queued_stripes s
          WHERE s.tenant_id = p_tenant AND s.band = p_band
          ORDER BY s.stripe
          FOR UPDATE SKIP LOCKED) AS s;
    IF v_stripes < 8 OR v_queued + v_striped <> 0 THEN
        RETURN false;
    END IF;
    -- No fold (stripes to 0, the row's queued to 0): it would cost a claim that drains a
    -- tenant more writes, and without it stripes only ever grow, so a snapshot's sum of them
    -- is never above the latest one and the callers' pre-check never overestimates a total.
    UPDATE tenant_class_counts c SET has_work = false
    WHERE c.tenant_id = p_tenant AND c.band = p_band;
    RETURN true;
END
$fn$
