CREATE FUNCTION turnstile_submit_allowance(
    p_tenant text,
    p_now timestamptz,                    -- NULL: now()
    p_default_rate double precision,      -- TURNSTILE_SUBMIT_RATE_PER_SECOND (NULL: none)
    p_default_burst integer               -- TURNSTILE_SUBMIT_BURST (NULL: a second's worth)
)
-- rate: tokens a second, NULL for no limit; burst: the bucket's size; tokens: in the bucket
-- now (a full bucket when it has no row yet). One row. A set-returning SQL function of one
-- SELECT, so PostgreSQL inlines it into the statement that calls it: no function call of its
-- own in turnstile_submit.
RETURNS TABLE (rate double precision, burst integer, tokens double precision)
LANGUAGE sql STABLE AS $fn$
    SELECT s.rate, s.burst,
           -- The same refill as turnstile_submit's spend: `rate` a second since the last
           -- refill, at most `burst`; a clock behind the bucket's earns nothing. Without a
           -- rate the bucket is not read at all.
           CASE WHEN s.rate IS NOT NULL THEN
               coalesce((SELECT least(s.burst::double precision,
                                      b.tokens + s.rate
                                          * greatest(0, extract(epoch FROM coalesce(p_now, now())
                                                                           - b.refilled_at)
                                                            ::double precision))
                         FROM submit_buckets b WHERE b.tenant_id = p_tenant),
                        s.burst)
           END
    FROM (SELECT o.rate,
                 CASE WHEN o.rate IS NOT NULL
                      THEN coalesce(o.burst, greatest(1, ceil(o.rate)::integer)) END AS burst
          -- A NULL override column means the process default (tenant_limits, migration 0010).
          FROM (SELECT coalesce(l.submit_rate_per_second, p_default_rate) AS rate,
                       coalesce(l.submit_burst, p_default_burst) AS burst
                FROM (SELECT 1) AS one
                LEFT JOIN tenant_limits l ON l.tenant_id = p_tenant) AS o) AS s
$fn$;
