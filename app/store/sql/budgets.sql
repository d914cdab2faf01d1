-- Model budgets (migration 0022, docs/model-budgets.md): a request and a token bucket per
-- model endpoint, the reservations model calls hold against them, and a provider's pause.
-- Each bucket holds at most one minute's budget and refills at that budget a minute; a
-- reservation refills the endpoint's buckets for the time since the last one and takes one
-- request and the call's estimated tokens, under the endpoint's row lock, so the budget is
-- exact across every process. NULL limits (the row's override, else the process default
-- passed in) mean unlimited.


-- name: model_budget_get
SELECT endpoint, requests_per_minute, tokens_per_minute, updated_at
FROM model_budgets
WHERE endpoint = :endpoint;


-- name: model_budget_set
-- An admin's overrides, in one upsert (NULL: the process default). A `keep_*` flag leaves
-- that column as it is (a CLI flag not given). The next reservation in every process reads
-- the new values: no restart. The buckets keep their levels; a lowered limit caps them at the
-- next refill.
INSERT INTO model_budgets AS b (endpoint, requests_per_minute, tokens_per_minute, updated_at)
VALUES (:endpoint, :requests_per_minute, :tokens_per_minute, {{now}})
ON CONFLICT (endpoint) DO UPDATE
SET requests_per_minute = CASE WHEN :keep_rpm THEN b.requests_per_minute
                               ELSE excluded.requests_per_minute END,
    tokens_per_minute = CASE WHEN :keep_tpm THEN b.tokens_per_minute
                             ELSE excluded.tokens_per_minute END,
    updated_at = excluded.updated_at
RETURNING endpoint, requests_per_minute, tokens_per_minute, updated_at;


-- name: model_budget_ensure
-- The endpoint's row, created at its first reservation (no lock taken when it exists):
-- model_budget_reserve then locks it.
INSERT INTO model_budgets (endpoint, updated_at)
VALUES (:endpoint, {{now}})
ON CONFLICT (endpoint) DO NOTHING;


-- name: model_budget_reserve
-- fenced
-- A model call's reservation, before it is sent: fenced on the run's lease (a run that lost
-- it reserves nothing and gets no row), under the endpoint's row lock held to the commit (the
-- caller's transaction is this statement and model_budget_ensure), so two processes never
-- both take the last tokens. First, reservations whose run no longer holds them under their
-- epoch (it crashed, was swept, or ended without settling) or past their expiry are deleted
-- and their tokens given back (not their requests: the call may have been sent). Then the
-- buckets are refilled for the time since, and the call takes one request and its tokens
-- (capped at a minute's budget: a call larger than the whole budget waits for a full bucket)
-- if both buckets have them and the endpoint is not paused; else nothing is taken and the
-- answer says how long until the buckets will have them (`wait_seconds`, `ready_at`) and why.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS MATERIALIZED (
    SELECT id, lease_epoch
    FROM runs WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
),
budget AS MATERIALIZED (
    SELECT b.endpoint, b.request_level, b.token_level, b.refilled_at, b.paused_until,
           coalesce(b.requests_per_minute, CAST(:default_rpm AS integer)) AS rpm,
           coalesce(b.tokens_per_minute, CAST(:default_tpm AS integer)) AS tpm
    FROM model_budgets b
    WHERE b.endpoint = :endpoint AND EXISTS (SELECT 1 FROM run)
    FOR UPDATE
),
stale AS (
    DELETE FROM model_reservations m
    USING budget, clock
    WHERE m.endpoint = budget.endpoint
      AND (m.expires_at <= clock.now
           OR NOT EXISTS (SELECT 1 FROM runs r
                          WHERE r.id = m.run_id AND r.lease_epoch = m.epoch
                            AND r.status = 'running'))
    RETURNING m.tokens
),
levels AS (
    SELECT b.endpoint, b.rpm, b.tpm, b.paused_until, clock.now,
           CASE WHEN b.rpm IS NOT NULL
                THEN least(b.rpm, coalesce(b.request_level, b.rpm)
                                  + e.elapsed * b.rpm / 60.0) END AS requests,
           CASE WHEN b.tpm IS NOT NULL
                THEN least(b.tpm, coalesce(b.token_level, b.tpm) + e.elapsed * b.tpm / 60.0
                                  + (SELECT coalesce(sum(s.tokens), 0) FROM stale s)) END
               AS tokens,
           least(CAST(:tokens AS integer), b.tpm) AS wanted
    FROM budget b, clock,
         LATERAL (SELECT greatest(extract(epoch FROM clock.now
                                          - coalesce(b.refilled_at, clock.now)), 0)
                  AS elapsed) AS e
),
decision AS MATERIALIZED (
    SELECT l.*,
           (l.paused_until IS NULL OR l.paused_until <= l.now)
           AND (l.requests IS NULL OR l.requests >= 1)
           AND (l.tokens IS NULL OR l.tokens >= l.wanted) AS granted,
           greatest(
               CASE WHEN l.paused_until > l.now
                    THEN extract(epoch FROM l.paused_until - l.now) ELSE 0 END,
               CASE WHEN l.requests < 1 THEN (1 - l.requests) * 60.0 / l.rpm ELSE 0 END,
               CASE WHEN l.tokens < l.wanted THEN (l.wanted - l.tokens) * 60.0 / l.tpm ELSE 0 END
           ) AS wait_seconds,
           CASE WHEN l.paused_until > l.now THEN 'paused'
                WHEN l.requests < 1 THEN 'requests'
                WHEN l.tokens < l.wanted THEN 'tokens' END AS short_of
    FROM levels l
),
taken AS (
    UPDATE model_budgets b
    SET request_level = d.requests - CASE WHEN d.granted THEN 1 ELSE 0 END,
        token_level = d.tokens - CASE WHEN d.granted THEN d.wanted ELSE 0 END,
        refilled_at = d.now,
        waits = b.waits + CASE WHEN d.granted THEN 0 ELSE 1 END
    FROM decision d
    WHERE b.endpoint = d.endpoint
),
held AS (
    INSERT INTO model_reservations (endpoint, run_id, epoch, tokens, created_at, expires_at)
    SELECT d.endpoint, run.id, run.lease_epoch, coalesce(d.wanted, CAST(:tokens AS integer)),
           d.now, d.now + make_interval(secs => CAST(:hold_seconds AS double precision))
    FROM run, decision d
    WHERE d.granted
    RETURNING id, tokens
)
SELECT d.granted, d.short_of, CAST(d.wait_seconds AS double precision) AS wait_seconds,
       d.now + make_interval(secs => CAST(d.wait_seconds AS double precision)) AS ready_at,
       (SELECT id FROM held) AS reservation_id, (SELECT tokens FROM held) AS tokens,
       d.rpm, d.tpm
FROM decision d;


-- name: model_budget_settle
-- A call's reservation settled with the usage the provider reported (0 tokens for a call the
-- provider refused): the reservation is deleted and the difference given back (or taken, when
-- the call used more than its estimate; the bucket may go below zero, and later calls wait
-- for it). A reservation already reclaimed (the run's lease lapsed meanwhile) gave its tokens
-- back then, so the whole usage is taken now. Not fenced on the run's lease: it records what
-- the provider spent, which no lease decides; it touches no run.
WITH held AS (
    DELETE FROM model_reservations WHERE id = :reservation_id RETURNING tokens
)
UPDATE model_budgets b
SET token_level = CASE WHEN b.token_level IS NULL THEN NULL
                       ELSE least(coalesce(b.tokens_per_minute, CAST(:default_tpm AS integer)),
                                  b.token_level + coalesce((SELECT tokens FROM held), 0)
                                  - CAST(:used_tokens AS integer)) END,
    requests_used = b.requests_used + 1,
    tokens_used = b.tokens_used + CAST(:used_tokens AS integer)
WHERE b.endpoint = :endpoint
RETURNING b.token_level;


-- name: model_budget_pause
-- A provider's 429 with Retry-After: the endpoint takes no reservation in any process until
-- then (a later pause never shortens an earlier one).
INSERT INTO model_budgets AS b (endpoint, paused_until, pauses, updated_at)
VALUES (:endpoint, {{now}} + make_interval(secs => CAST(:seconds AS double precision)), 1,
        {{now}})
ON CONFLICT (endpoint) DO UPDATE
SET paused_until = greatest(b.paused_until, excluded.paused_until),
    pauses = b.pauses + 1
RETURNING paused_until;


-- name: model_budget_figures
-- Every endpoint's budget and figures, for the admin's view and the metrics: the overrides,
-- the running totals, the pause, and what open reservations hold now (one bounded scan of
-- the reservations, which are at most one per model call in flight).
SELECT b.endpoint, b.requests_per_minute, b.tokens_per_minute, b.updated_at,
       b.request_level, b.token_level, b.refilled_at, b.paused_until,
       b.requests_used, b.tokens_used, b.waits, b.pauses,
       coalesce(m.reservations, 0) AS reservations, coalesce(m.tokens, 0) AS reserved_tokens
FROM model_budgets b
LEFT JOIN (SELECT endpoint, count(*) AS reservations, sum(tokens) AS tokens
           FROM model_reservations GROUP BY endpoint) AS m ON m.endpoint = b.endpoint
WHERE CAST(:endpoint AS text) IS NULL OR b.endpoint = :endpoint
ORDER BY b.endpoint
LIMIT 200;
