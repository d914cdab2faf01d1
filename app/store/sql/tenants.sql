-- Tenants: an admin's limit overrides (tenant_limits, migration 0010), a tenant's submission
-- allowance (its token bucket, migration 0012), and the per-tenant running and queued counts
-- (tenant_class_counts) the runbook, the dashboard and the metrics read. The counts are kept
-- exact by the transitions themselves, so every figure here reads a few rows per tenant and
-- never counts runs.


-- name: tenant_limits_get
SELECT tenant_id, max_running, max_queued, submit_rate_per_second, submit_burst,
       max_schedules, max_webhook_endpoints, min_schedule_interval_seconds, updated_at
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
                                submit_burst, max_schedules, max_webhook_endpoints,
                                min_schedule_interval_seconds, updated_at)
VALUES (:tenant_id, jsonb_strip_nulls(CAST(:max_running AS jsonb)), :max_queued,
        :submit_rate_per_second, :submit_burst, :max_schedules, :max_webhook_endpoints,
        :min_schedule_interval_seconds, {{now}})
ON CONFLICT (tenant_id) DO UPDATE
SET max_running = CASE WHEN :replace_classes THEN excluded.max_running
                       ELSE jsonb_strip_nulls(l.max_running || CAST(:max_running AS jsonb))
                  END,
    max_queued = CASE WHEN :keep_max_queued THEN l.max_queued ELSE excluded.max_queued END,
    submit_rate_per_second = CASE WHEN :keep_submit_rate THEN l.submit_rate_per_second
                                  ELSE excluded.submit_rate_per_second END,
    submit_burst = CASE WHEN :keep_submit_burst THEN l.submit_burst
                        ELSE excluded.submit_burst END,
    max_schedules = CASE WHEN :keep_max_schedules THEN l.max_schedules
                         ELSE excluded.max_schedules END,
    max_webhook_endpoints = CASE WHEN :keep_max_webhook_endpoints THEN l.max_webhook_endpoints
                                 ELSE excluded.max_webhook_endpoints END,
    min_schedule_interval_seconds = CASE WHEN :keep_min_schedule_interval
                                         THEN l.min_schedule_interval_seconds
                                         ELSE excluded.min_schedule_interval_seconds END,
    updated_at = excluded.updated_at
RETURNING tenant_id, max_running, max_queued, submit_rate_per_second, submit_burst,
          max_schedules, max_webhook_endpoints, min_schedule_interval_seconds, updated_at;


-- name: lock_tenant_holdings
-- Taken first by a creation of a schedule or a webhook endpoint, in its transaction: two
-- creations of one tenant's holdings count one after the other, so the caps below are exact
-- (without it two concurrent creations would each see one under the cap and both insert).
-- The class id is this one's own (turnstile_mark_work's is 1953724267); tenants whose names
-- hash alike only wait for each other.
SELECT pg_advisory_xact_lock(1953724268, hashtext(:tenant_id));


-- name: tenant_holdings
-- The tenant's overrides of the holdings' limits (NULL: the process default), and how many
-- schedules and live webhook endpoints it holds, each counted through its tenant index up to
-- the cap that applies (the override, else the default given): a tenant at its cap is refused, and a
-- read never grows past the cap it is compared with. Without any cap nothing is counted (0).
SELECT l.max_schedules, l.max_webhook_endpoints, l.min_schedule_interval_seconds,
       (SELECT count(*)
        FROM (SELECT 1 FROM schedules WHERE tenant_id = :tenant_id
              LIMIT coalesce(l.max_schedules, CAST(:default_max_schedules AS integer), 0)) AS s
       ) AS schedules,
       (SELECT count(*)
        FROM (SELECT 1 FROM webhook_endpoints
              -- An A2A task's push configurations are capped per task instead.
              WHERE tenant_id = :tenant_id AND deleted_at IS NULL AND run_id IS NULL
              LIMIT coalesce(l.max_webhook_endpoints,
                             CAST(:default_max_webhook_endpoints AS integer), 0)) AS e
       ) AS webhook_endpoints
FROM (SELECT 1) AS one
LEFT JOIN tenant_limits l ON l.tenant_id = :tenant_id;


-- name: submit_allowance
-- A tenant's submission rate limit and its bucket as they stand, without a lock and without
-- spending (migration 0012's function, as turnstile_submit reads it): the RateLimit headers
-- of a submission refused before its bucket step.
SELECT rate, burst, tokens
FROM turnstile_submit_allowance(:tenant_id, {{now}}, :default_rate, :default_burst);


-- name: tenant_depth
-- Running and queued runs per tenant and class band: running from the count rows (exact),
-- queued counted from the queued runs themselves (ix_runs_tenant_claim), at most
-- :max_counted of them: past that the queued figures are floors, and the read stays bounded
-- however deep the queue. With :tenant_id, that tenant's rows only. Otherwise the :top
-- tenants by queued runs (then running, then name) one by one, and every other tenant with
-- work summed in rows whose tenant_id is NULL: the result is bounded whatever the number of
-- tenants (the metrics' series, the admin's view).
WITH queued AS (
    SELECT q.tenant_id, CAST(q.priority / 10 AS smallint) AS band, count(*) AS queued
    FROM (SELECT r.tenant_id, r.priority FROM runs r
          WHERE r.status = 'queued'
            AND (CAST(:tenant_id AS text) IS NULL OR r.tenant_id = :tenant_id)
          LIMIT :max_counted) AS q
    GROUP BY 1, 2
),
running AS (
    SELECT c.tenant_id, c.band, c.running FROM tenant_class_counts c
    WHERE c.running > 0 AND (CAST(:tenant_id AS text) IS NULL OR c.tenant_id = :tenant_id)
),
per_pair AS (
    SELECT coalesce(r.tenant_id, q.tenant_id) AS tenant_id, coalesce(r.band, q.band) AS band,
           coalesce(r.running, 0) AS running, coalesce(q.queued, 0) AS queued
    FROM running r FULL JOIN queued q ON q.tenant_id = r.tenant_id AND q.band = r.band
),
ranked AS (
    SELECT tenant_id, row_number() OVER (ORDER BY sum(queued) DESC, sum(running) DESC,
                                                   tenant_id) AS rank
    FROM per_pair
    GROUP BY tenant_id
)
SELECT CASE WHEN r.rank <= :top THEN p.tenant_id END AS tenant_id,
       min(r.rank) AS rank,
       p.band,
       sum(p.running) AS running,
       sum(p.queued) AS queued
FROM ranked r
JOIN per_pair p ON p.tenant_id = r.tenant_id
GROUP BY 1, p.band
ORDER BY 2, 3;


-- name: settle_idle_work
-- The settler's pass (docs/adr/0009): up to :limit pairs marked as having work to claim but
-- with none eligible now (a claim walks such a pair at most once before settling it; this
-- catches those no claim walks), offered to turnstile_settle_work in key order. The function
-- never waits and clears only what it proves idle.
SELECT count(*) AS offered,
       count(*) FILTER (WHERE turnstile_settle_work(i.tenant_id, i.band, {{now}})) AS cleared
FROM (
    SELECT c.tenant_id, c.band FROM tenant_class_counts c
    WHERE c.has_work
      AND NOT EXISTS (
          SELECT 1 FROM generate_series(c.band * 10, c.band * 10 + 9) AS p(priority)
          CROSS JOIN LATERAL (
              SELECT 1 FROM runs q
              WHERE q.tenant_id = c.tenant_id AND q.status = 'queued'
                AND q.priority = p.priority
                AND coalesce(q.scheduled_for, q.created_at) <= {{now}}
              LIMIT 1) AS found)
    ORDER BY c.tenant_id, c.band
    LIMIT :limit
) AS i;
