CREATE OR REPLACE FUNCTION turnstile_claim_heads(
    p_tenant text,
    p_priorities smallint[],   -- one band's priorities, highest first
    p_now timestamptz,
    p_take integer,
    p_held uuid[]              -- runs this claim holds already (its own locks do not skip them)
)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE AS $fn$
-- Up to p_take of a tenant's runs to claim now, for turnstile_claim: its highest priority
-- first, then the longest eligible, each priority one bounded range of ix_runs_tenant_claim
-- (no walk over backed-off or scheduled runs), locked FOR UPDATE SKIP LOCKED. Webhook
-- deliveries and schedule ticks are runs like the others here: they count against the
-- tenant's concurrency limit (the caller does not ask for a tenant at its limit). PL/pgSQL
-- for its kept plan (a SQL function's would be made again at every call).
BEGIN
    RETURN QUERY
    SELECT h.id FROM unnest(p_priorities) AS p(priority)
    CROSS JOIN LATERAL (
        SELECT q.id FROM runs q
        WHERE q.tenant_id = p_tenant AND q.status = 'queued'
          AND q.priority = p.priority
          AND coalesce(q.scheduled_for, q.created_at) <= p_now
          -- Never a run past its deadline to start (the expirer ends it); a filter on the
          -- rows the range reads, so the index scan and its order stay as they are.
          AND (q.start_before IS NULL OR q.start_before > p_now OR q.started_at IS NOT NULL)
          AND q.id <> ALL(p_held)
        ORDER BY coalesce(q.scheduled_for, q.created_at)
        LIMIT p_take
        FOR UPDATE SKIP LOCKED) AS h
    LIMIT p_take;
END
$fn$;
