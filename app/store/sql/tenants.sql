-- Tenants: an admin's limit overrides (tenant_limits, migration 0010), a tenant's submission
-- allowance (its token bucket, migration 0012), and the per-tenant running and queued counts
-- (tenant_class_counts) the runbook, the dashboard and the metrics read. The counts are kept
-- exact by the transitions themselves, so every figure here reads a few rows per tenant and
-- never counts runs.


-- name: tenant_limits_get
SELECT tenant_id, max_running, max_queued, submit_rate_per_second, submit_burst, updated_at
FROM tenant_limits
WHERE tenant_id = :tenant_id;


-- name: tenant_limits_set
-- One upsert. A NULL column, or a class missing from max_running, is the process default.
-- :max_running holds the classes this change names (a null value removes the class's
-- override); with :replace_classes the named classes are the whole set (PUT), without it they
-- are merged into the row's (the CLI's `--max-running CLASS=N`). A `keep_*` flag leaves that
-- column as it is (a CLI flag not given). Reads of the row (claims, submissions) see the new
-- values from their next statement on: no restart.
INSERT INTO tenant_limits AS l (tenant_id, max_running, max_queued, submit_rate_per_second,
                                submit_burst, updated_at)
VALUES (:tenant_id, jsonb_strip_nulls(CAST(:max_running AS jsonb)), :max_queued,
        :submit_rate_per_second, :submit_burst, {{now}})
ON CONFLICT (tenant_id) DO UPDATE
SET max_running = CASE WHEN :replace_classes THEN excluded.max_running
                       ELSE jsonb_strip_nulls(l.max_running || CAST(:max_running AS jsonb))
                  END,
    max_queued = CASE WHEN :keep_max_queued THEN l.max_queued ELSE excluded.max_queued END,
    submit_rate_per_second = CASE WHEN :keep_submit_rate THEN l.submit_rate_per_second
                                  ELSE excluded.submit_rate_per_second END,
    submit_burst = CASE WHEN :keep_submit_burst THEN l.submit_burst
                        ELSE excluded.submit_burst END,
    updated_at = excluded.updated_at
RETURNING tenant_id, max_running, max_queued, submit_rate_per_second, submit_burst, updated_at;


-- name: submit_allowance
-- A tenant's submission rate limit and its bucket as they stand, without a lock and without
-- spending (migration 0012's function, as turnstile_submit reads it): the RateLimit headers
-- of a submission refused before its bucket step.
SELECT rate, burst, tokens
FROM turnstile_submit_allowance(:tenant_id, {{now}}, :default_rate, :default_burst);


-- name: tenant_depth
-- Running and queued runs per tenant and class band, from tenant_class_totals (the count rows
-- with their stripes: a few rows per tenant, never the runs). With :tenant_id, that tenant's rows only. Otherwise the
-- :top tenants by queued runs (then running, then name) one by one, and every other tenant
-- with work summed in rows whose tenant_id is NULL: the result is bounded whatever the number
-- of tenants (the metrics' series, the admin's view).
WITH per_tenant AS (
    SELECT tenant_id, sum(queued) AS queued, sum(running) AS running
    FROM tenant_class_totals
    WHERE (CAST(:tenant_id AS text) IS NULL OR tenant_id = :tenant_id)
    GROUP BY tenant_id
    HAVING sum(queued) + sum(running) > 0
),
ranked AS (
    SELECT tenant_id, queued, running,
           row_number() OVER (ORDER BY queued DESC, running DESC, tenant_id) AS rank
    FROM per_tenant
)
SELECT CASE WHEN r.rank <= :top THEN c.tenant_id END AS tenant_id,
       min(r.rank) AS rank,
       c.band,
       sum(c.running) AS running,
       sum(c.queued) AS queued
FROM ranked r
JOIN tenant_class_totals c ON c.tenant_id = r.tenant_id
GROUP BY 1, c.band
ORDER BY 2, 3;


-- name: clear_idle_work
-- The backstop for stale has_work flags (docs/adr/0006, "Striped queued counts"): the claims,
-- and every statement that takes runs out of queued offer a (tenant, class) to
-- turnstile_clear_work when their snapshot says it is empty, but a clear that found a stripe
-- locked by an enqueue that then rolled back, or an enqueue rolled back after its mark, can
-- leave the flag set with nothing queued: the walk then probes that tenant for nothing. Up to
-- :limit flagged rows whose total reads 0 or less are offered, in key order; the function
-- never waits and clears only what it proves empty. Returns the rows offered and cleared.
SELECT count(*) AS offered,
       count(*) FILTER (WHERE turnstile_clear_work(i.tenant_id, i.band)) AS cleared
FROM (
    SELECT c.tenant_id, c.band FROM tenant_class_counts c
    WHERE c.has_work
      AND c.queued + (SELECT coalesce(sum(s.queued), 0) FROM tenant_queued_stripes s
                      WHERE s.tenant_id = c.tenant_id AND s.band = c.band) <= 0
    ORDER BY c.tenant_id, c.band
    LIMIT :limit
) AS i;
