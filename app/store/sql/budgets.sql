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


-- name: model_tenant_ensure
-- The run's tenant's row on the endpoint (its buckets and totals), created at its first
-- reservation there (no lock taken when it exists): model_budget_reserve then locks it.
INSERT INTO model_tenant_budgets (endpoint, tenant_id, updated_at)
SELECT :endpoint, r.tenant_id, {{now}}
FROM runs r
WHERE r.id = :run_id
ON CONFLICT (endpoint, tenant_id) DO NOTHING;


-- name: model_budget_reserve
-- fenced
-- A model call's reservation, before it is sent: fenced on the run's lease (a run that lost
-- it reserves nothing and gets no row), under the endpoint's row lock held to the commit (the
-- caller's transaction is this statement and model_budget_ensure), so two processes never
-- both take the last tokens. First, held reservations whose run no longer holds them under
-- their epoch (it crashed, was swept, or ended without settling) are deleted and their tokens
-- given back (not their requests: the call may have been sent); so are reservations and
-- bookings past their expiry (a booking's request too: it was never sent). Then the buckets
-- are refilled for the time since, and one of these is done (the endpoint paused by a 429
-- takes no call, and answers with the pause's end):
-- * the run has a booking of its own (it waited for its turn): the booking becomes the
--   call's reservation once the buckets cover it (`ready_requests_at`, and `ready_tokens_at`
--   less the budget's token_advance: every token a settlement gave back since brings every
--   booking forward at once), else the answer says when they will;
-- * both buckets have the call's request and tokens (capped at a minute's budget: a call
--   larger than the whole budget waits for a full bucket): they are taken and held. An
--   async or maintenance call must leave `interactive_share` of a minute's budget in them
--   (at most what the call leaves of a full bucket) while interactive calls are in flight
--   or booked on the endpoint: that share is theirs alone, so a stream of async calls
--   cannot spend every refill before the next interactive call asks;
-- * an interactive call, when an async call's booking is not due yet: it takes that booking's
--   turn (the async run, when it comes, books again at the end): interactive before async;
--   likewise a call of a tenant holding fewer bookings of its class than another tenant by
--   two or more takes that tenant's next turn: fair between tenants;
-- * else the call is booked: its request and tokens are taken now, the buckets going below
--   zero, so each waiting call has its own turn and every later call waits behind it (no herd
--   woken at one moment, no call taking the turn of one that waited). Its run is told to come
--   back at `wake_at`: when the buckets will cover it, counting on the tokens settlements of
--   the calls ahead of it will give back (their share the budget's moving average says).
-- A tenant's own limit on the endpoint (model_tenant_budgets, migration 0030) comes first:
-- a call without a booking of the endpoint's passes its tenant's buckets before it asks the
-- endpoint's (grant, bump or book above), which it takes from only then. One its tenant's
-- buckets cannot take is booked on them alone (`tenant_book`: a model_tenant_bookings row,
-- the tenant's buckets below zero, the run told to come back at its turn there): it holds
-- nothing of the endpoint's and takes no turn of another tenant's meanwhile. Back at its
-- turn (`due`), it asks the endpoint's budget as any call, its tenant's share already taken.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
run AS MATERIALIZED (
    SELECT id, lease_epoch, priority / 10 AS band, tenant_id
    FROM runs WHERE id = :run_id AND lease_epoch = :epoch AND status = 'running'
),
budget AS MATERIALIZED (
    SELECT b.endpoint, b.request_level, b.token_level, b.refilled_at, b.paused_until,
           b.token_advance, b.used_share,
           -- Never above what the provider's headers said (least ignores a NULL).
           least(coalesce(b.requests_per_minute, CAST(:default_rpm AS integer)),
                 b.provider_rpm) AS rpm,
           least(coalesce(b.tokens_per_minute, CAST(:default_tpm AS integer)),
                 b.provider_tpm) AS tpm
    FROM model_budgets b
    WHERE b.endpoint = :endpoint AND EXISTS (SELECT 1 FROM run)
    FOR UPDATE
),
tenant_budget AS MATERIALIZED (
    -- The call's tenant's row on the endpoint (model_tenant_ensure made it), locked after the
    -- endpoint's row: every statement that locks tenants' rows of an endpoint holds that
    -- first (a settlement too), so none waits for another in the opposite order. Its limits:
    -- its own on the endpoint, else its tenant's on every endpoint (the row of endpoint '').
    SELECT t.tenant_id, t.request_level, t.token_level, t.refilled_at,
           coalesce(t.requests_per_minute, e.requests_per_minute) AS rpm,
           coalesce(t.tokens_per_minute, e.tokens_per_minute) AS tpm
    FROM model_tenant_budgets t
    JOIN run ON run.tenant_id = t.tenant_id
    LEFT JOIN model_tenant_budgets e ON e.endpoint = '' AND e.tenant_id = t.tenant_id
    WHERE t.endpoint = :endpoint AND EXISTS (SELECT 1 FROM budget)
    FOR UPDATE OF t
),
stale AS (
    DELETE FROM model_reservations m
    USING budget, clock
    WHERE m.endpoint = budget.endpoint
      AND (m.expires_at <= clock.now
           OR (m.wake_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM runs r
                               WHERE r.id = m.run_id AND r.lease_epoch = m.epoch
                                 AND r.status = 'running')))
    RETURNING m.tokens, m.wake_at IS NOT NULL AS booked, m.tenant_id, m.tenant_tokens
),
tenant_stale AS (
    -- Calls booked on their tenant's buckets whose runs did not come back in time (cancelled,
    -- or their workers busy): their request and tokens go back to their tenants' buckets.
    DELETE FROM model_tenant_bookings k
    USING budget, clock
    WHERE k.endpoint = budget.endpoint AND k.expires_at <= clock.now
    RETURNING k.tenant_id, k.tokens
),
tenant_freed AS MATERIALIZED (
    -- Per tenant, what the holds given back above had taken of its buckets: a booking's
    -- request and tokens (never sent), a call in flight's tokens (it may have been sent).
    SELECT x.tenant_id, sum(x.tokens) AS tokens, sum(x.requests) AS requests
    FROM (SELECT s.tenant_id, s.tenant_tokens AS tokens,
                 CASE WHEN s.booked THEN 1 ELSE 0 END AS requests
          FROM stale s WHERE s.tenant_tokens IS NOT NULL
          UNION ALL
          SELECT k.tenant_id, k.tokens, 1 FROM tenant_stale k) AS x
    GROUP BY x.tenant_id
),
freed AS (
    SELECT coalesce(sum(s.tokens), 0) AS tokens,
           count(*) FILTER (WHERE s.booked) AS requests,
           coalesce(sum(s.tokens) FILTER (WHERE s.booked), 0) AS booked_tokens
    FROM stale s
),
own AS MATERIALIZED (
    -- The run's booking (disjoint from stale: not past its expiry).
    SELECT m.id, m.tokens, m.ready_requests_at, m.ready_tokens_at
    FROM model_reservations m, clock
    WHERE m.endpoint = :endpoint AND m.run_id = :run_id AND m.wake_at IS NOT NULL
      AND m.expires_at > clock.now
    ORDER BY m.created_at
    LIMIT 1
),
own_tenant AS MATERIALIZED (
    -- The run's booking on its tenant's buckets (disjoint from tenant_stale).
    SELECT k.id, k.tokens, k.ready_at
    FROM model_tenant_bookings k, clock
    WHERE k.endpoint = :endpoint AND k.run_id = :run_id AND k.expires_at > clock.now
    ORDER BY k.created_at
    LIMIT 1
),
outstanding AS (
    -- What the calls in flight and the bookings hold: settled, they give part of it back.
    SELECT coalesce(sum(m.tokens), 0) AS tokens
    FROM model_reservations m, clock
    WHERE m.endpoint = :endpoint AND m.expires_at > clock.now
),
interactive AS (
    -- Interactive calls in flight or booked on the endpoint: while there are, async and
    -- maintenance calls leave them their share; when there are none, nothing is held back
    -- (a share kept for nobody made an async backlog finish 12 % late), and the next
    -- interactive call takes an async booking's turn instead.
    SELECT EXISTS (SELECT 1 FROM model_reservations m, clock
                   WHERE m.endpoint = :endpoint AND m.band = 0
                     AND m.expires_at > clock.now) AS present
),
levels AS (
    -- `now` never before the last refill: a transaction that began (its clock read) before
    -- another that refilled and committed while this one waited for the row lock must not
    -- refill that time again (the clock going back gave out the same seconds twice).
    SELECT b.endpoint, b.rpm, b.tpm, b.paused_until, b.used_share, run.band, run.tenant_id,
           greatest(clock.now, coalesce(b.refilled_at, clock.now)) AS now,
           b.token_advance + CASE WHEN b.tpm IS NOT NULL
                                  THEN f.booked_tokens * 60.0 / b.tpm ELSE 0 END AS advance,
           CASE WHEN b.rpm IS NOT NULL
                THEN least(b.rpm, coalesce(b.request_level, b.rpm)
                                  + e.elapsed * b.rpm / 60.0 + f.requests) END AS requests,
           CASE WHEN b.tpm IS NOT NULL
                THEN least(b.tpm, coalesce(b.token_level, b.tpm) + e.elapsed * b.tpm / 60.0
                                  + f.tokens) END AS tokens,
           least(CAST(:tokens AS integer), b.tpm) AS wanted,
           -- What an async or maintenance call must leave in the buckets for interactive
           -- calls while any are in flight or booked: the share of a minute's budget, never
           -- so much that a full bucket could not take the call (one request a minute leaves
           -- none). Zero for interactive calls and with none about; NULL for an unlimited
           -- bucket.
           CASE WHEN run.band = 0 OR NOT i.present THEN 0
                ELSE least(CAST(:interactive_share AS float8) * b.rpm, b.rpm - 1) END
               AS held_requests,
           CASE WHEN run.band = 0 OR NOT i.present THEN 0
                ELSE least(CAST(:interactive_share AS float8) * b.tpm,
                           b.tpm - least(CAST(:tokens AS integer), b.tpm)) END
               AS held_tokens,
           (SELECT o.tokens FROM outstanding o) AS outstanding
    FROM budget b, clock, freed f, run, interactive i,
         LATERAL (SELECT greatest(extract(epoch FROM clock.now
                                          - coalesce(b.refilled_at, clock.now)), 0)
                  AS elapsed) AS e
),
tenant_levels AS (
    -- The tenant's buckets refilled to the endpoint's `now` (each refill of them happens
    -- under the endpoint's row lock, at that statement's `now`: never later than this one's),
    -- with what its stale holds gave back; NULL: no limit of the tenant's.
    SELECT tb.rpm AS t_rpm, tb.tpm AS t_tpm,
           CASE WHEN tb.rpm IS NOT NULL
                THEN least(tb.rpm, coalesce(tb.request_level, tb.rpm) + e.elapsed * tb.rpm / 60.0
                                   + coalesce(tf.requests, 0)) END AS t_requests,
           CASE WHEN tb.tpm IS NOT NULL
                THEN least(tb.tpm, coalesce(tb.token_level, tb.tpm) + e.elapsed * tb.tpm / 60.0
                                   + coalesce(tf.tokens, 0)) END AS t_tokens,
           -- NULL without a token limit (least ignores a NULL): its share is then a request.
           CASE WHEN tb.tpm IS NOT NULL THEN least(CAST(:tokens AS integer), tb.tpm) END
               AS t_wanted
    FROM tenant_budget tb
    CROSS JOIN levels l
    LEFT JOIN tenant_freed tf ON tf.tenant_id = tb.tenant_id
    CROSS JOIN LATERAL (SELECT greatest(extract(epoch FROM l.now
                                                - coalesce(tb.refilled_at, l.now)), 0)
                        AS elapsed) AS e
),
decision AS MATERIALIZED (
    SELECT l.*, o.id AS own_id, o.tokens AS own_tokens,
           greatest(o.ready_requests_at,
                    o.ready_tokens_at - make_interval(secs => l.advance)) AS own_due,
           coalesce(l.paused_until > l.now, false) AS paused,
           (l.requests IS NULL OR l.requests >= 1 + l.held_requests)
           AND (l.tokens IS NULL OR l.tokens >= l.wanted + l.held_tokens) AS fits,
           t.t_rpm, t.t_tpm, t.t_requests, t.t_tokens, t.t_wanted,
           ot.id AS own_tenant_id, ot.tokens AS own_tenant_tokens, ot.ready_at AS own_tenant_at,
           -- Where the call stands with its tenant's limit: `none` with a booking of the
           -- endpoint's (its tenant's share was taken when it booked) or during a pause (it
           -- takes nothing); back for its booking on the tenant's buckets, `due` or `wait`;
           -- else `unlimited`, `fits` (taken with the endpoint's) or `short` (booked there).
           CASE WHEN o.id IS NOT NULL OR coalesce(l.paused_until > l.now, false) THEN 'none'
                WHEN ot.id IS NOT NULL
                THEN CASE WHEN ot.ready_at <= l.now THEN 'due' ELSE 'wait' END
                WHEN t.t_rpm IS NULL AND t.t_tpm IS NULL THEN 'unlimited'
                WHEN (t.t_requests IS NULL OR t.t_requests >= 1)
                     AND (t.t_tokens IS NULL OR t.t_tokens >= t.t_wanted) THEN 'fits'
                ELSE 'short' END AS tenant_state
    FROM levels l LEFT JOIN own o ON true LEFT JOIN own_tenant ot ON true
    LEFT JOIN tenant_levels t ON true
),
booked_by_tenant AS (
    -- The bookings of the call's class, per tenant: a tenant's flood of them is not a reason
    -- for another tenant's call to wait behind all of it.
    SELECT m.tenant_id, count(*) AS bookings
    FROM model_reservations m, decision d
    WHERE d.own_id IS NULL AND NOT d.paused AND NOT d.fits
      AND d.tenant_state IN ('due', 'unlimited', 'fits')
      AND m.endpoint = d.endpoint AND m.wake_at IS NOT NULL AND m.band = d.band
      AND m.expires_at > d.now
    GROUP BY m.tenant_id
),
victim AS MATERIALIZED (
    -- The booking whose turn the call takes, the next to come due of: a lower class's (an
    -- interactive call takes an async booking's turn), else one of its own class's, of a
    -- tenant holding at least two more of them than the call's tenant (the fair share of
    -- docs/adr/0006 on the budget: the later tenant's calls are interleaved with the flood,
    -- not put behind it).
    SELECT m.id, m.wake_at, m.tenant_id, m.tenant_tokens
    FROM model_reservations m, decision d
    -- A call its tenant's limit holds back takes no turn of anyone's.
    WHERE d.own_id IS NULL AND NOT d.paused AND NOT d.fits
      AND d.tenant_state IN ('due', 'unlimited', 'fits')
      AND m.endpoint = d.endpoint AND m.wake_at IS NOT NULL
      AND m.wake_at > d.now AND m.expires_at > d.now
      AND m.tokens >= coalesce(d.wanted, 0)
      AND (m.band > d.band
           OR (m.band = d.band AND m.tenant_id IS DISTINCT FROM d.tenant_id
               AND coalesce((SELECT t.bookings FROM booked_by_tenant t
                             WHERE t.tenant_id = m.tenant_id), 0)
                   >= coalesce((SELECT t.bookings FROM booked_by_tenant t
                                WHERE t.tenant_id = d.tenant_id), 0) + 2))
    ORDER BY m.band > d.band DESC, m.wake_at
    LIMIT 1
    FOR UPDATE OF m SKIP LOCKED
),
plan AS MATERIALIZED (
    SELECT d.*, v.id AS victim_id, v.tenant_id AS victim_tenant,
           v.tenant_tokens AS victim_tenant_tokens,
           CASE WHEN d.own_id IS NOT NULL
                THEN CASE WHEN NOT d.paused AND d.own_due <= d.now THEN 'convert'
                          ELSE 'wait' END
                WHEN d.paused THEN 'wait'
                WHEN d.tenant_state = 'wait' THEN 'tenant_wait'
                WHEN d.tenant_state = 'short' THEN 'tenant_book'
                WHEN d.fits THEN 'grant'
                WHEN v.id IS NOT NULL THEN 'bump'
                ELSE 'book' END AS action,
           -- A booking's turn: when the buckets will hold its request and tokens (and, for
           -- an async or maintenance call, the interactive share beside them).
           d.now + make_interval(secs => CASE WHEN d.requests IS NULL
                                                   OR d.requests >= 1 + d.held_requests THEN 0
                                              ELSE (1 + d.held_requests - d.requests)
                                                   * 60.0 / d.rpm END)
               AS book_requests_at,
           d.now + make_interval(secs => CASE WHEN d.tokens IS NULL
                                                   OR d.tokens >= d.wanted + d.held_tokens
                                              THEN 0
                                              ELSE (d.wanted + d.held_tokens - d.tokens)
                                                   * 60.0 / d.tpm END
                                         + d.advance) AS book_tokens_at,
           greatest(
               d.now + make_interval(secs => CASE WHEN d.requests IS NULL
                                                       OR d.requests >= 1 + d.held_requests
                                                  THEN 0
                                                  ELSE (1 + d.held_requests - d.requests)
                                                       * 60.0 / d.rpm END),
               d.now + make_interval(secs => CASE
                   WHEN d.tokens IS NULL THEN 0
                   ELSE greatest(d.wanted + d.held_tokens - d.tokens
                                 - (1 - d.used_share) * d.outstanding, 0)
                        * 60.0 / d.tpm END)) AS book_wake_at,
           -- Its turn on its tenant's buckets, when both cover it (no give-back counted on).
           d.now + make_interval(secs => greatest(
               CASE WHEN d.t_requests IS NULL OR d.t_requests >= 1 THEN 0
                    ELSE (1 - d.t_requests) * 60.0 / d.t_rpm END,
               CASE WHEN d.t_tokens IS NULL OR d.t_tokens >= d.t_wanted THEN 0
                    ELSE (d.t_wanted - d.t_tokens) * 60.0 / d.t_tpm END)) AS tenant_book_at,
           v.wake_at AS victim_wake_at
    FROM decision d LEFT JOIN victim v ON true
),
answer AS MATERIALIZED (
    SELECT p.*,
           p.action IN ('convert', 'grant') AS granted,
           CASE p.action
               WHEN 'wait' THEN greatest(CASE WHEN p.paused THEN p.paused_until END,
                                         CASE WHEN p.own_due > p.now THEN p.own_due END)
               WHEN 'bump' THEN p.victim_wake_at
               WHEN 'book' THEN p.book_wake_at
               WHEN 'tenant_wait' THEN p.own_tenant_at
               WHEN 'tenant_book' THEN p.tenant_book_at
           END AS ready_at,
           CASE WHEN p.action IN ('convert', 'grant') THEN NULL
                WHEN p.paused THEN 'paused'
                WHEN p.action = 'wait' AND p.own_due > p.now THEN 'booked'
                WHEN p.action = 'tenant_wait' THEN 'tenant_booked'
                WHEN p.action = 'tenant_book'
                THEN CASE WHEN p.t_requests < 1 THEN 'tenant_requests' ELSE 'tenant_tokens' END
                -- Room for the call, but not beside the interactive share it must leave.
                WHEN (p.requests IS NULL OR p.requests >= 1)
                     AND (p.tokens IS NULL OR p.tokens >= p.wanted) THEN 'interactive_share'
                WHEN p.requests < 1 THEN 'requests'
                ELSE 'tokens' END AS short_of,
           -- What the call takes of its tenant's buckets now: a request and its tokens when
           -- it passes them (`fits`) and the endpoint takes it, or books it on them.
           (p.tenant_state = 'fits' AND p.action IN ('grant', 'bump', 'book'))
           OR p.action = 'tenant_book' AS tenant_takes,
           -- What its reservation (or the endpoint's booking) holds of its tenant's tokens.
           CASE WHEN p.tenant_state = 'fits' THEN coalesce(p.t_wanted, 0)
                WHEN p.tenant_state = 'due' THEN p.own_tenant_tokens END AS tenant_tokens
    FROM plan p
),
taken AS (
    UPDATE model_budgets b
    SET request_level = a.requests - CASE WHEN a.action IN ('grant', 'book') THEN 1 ELSE 0 END,
        token_level = a.tokens
                      - CASE WHEN a.action IN ('grant', 'book') THEN a.wanted
                             WHEN a.action = 'convert'
                             THEN greatest(coalesce(a.wanted, 0) - a.own_tokens, 0)
                             ELSE 0 END,
        token_advance = a.advance,
        refilled_at = a.now,
        waits = b.waits + CASE WHEN a.granted THEN 0 ELSE 1 END
    FROM answer a
    WHERE b.endpoint = a.endpoint
),
tenant_taken AS (
    -- Every tenant's row this statement changes, in one UPDATE (a row updated by two of a
    -- statement's CTEs keeps only one of the changes): the call's tenant's buckets refilled to
    -- now (what its stale holds gave back included) less what the call takes; every other
    -- tenant's, what its stale holds gave back; the tenant of a booking whose turn the call
    -- took gets its request and tokens back (its run, when it comes, passes its limit again).
    UPDATE model_tenant_budgets t
    SET request_level =
            CASE WHEN t.tenant_id = a.tenant_id
                 THEN CASE WHEN a.t_rpm IS NULL THEN t.request_level
                           ELSE a.t_requests - CASE WHEN a.tenant_takes THEN 1 ELSE 0 END END
                 ELSE t.request_level + coalesce((SELECT f.requests FROM tenant_freed f
                                                  WHERE f.tenant_id = t.tenant_id), 0) END
            + CASE WHEN a.action = 'bump' AND a.victim_tenant_tokens IS NOT NULL
                        AND t.tenant_id = a.victim_tenant THEN 1 ELSE 0 END,
        token_level =
            CASE WHEN t.tenant_id = a.tenant_id
                 THEN CASE WHEN a.t_tpm IS NULL THEN t.token_level
                           ELSE a.t_tokens
                                - CASE WHEN a.tenant_takes THEN a.t_wanted ELSE 0 END END
                 ELSE t.token_level + coalesce((SELECT f.tokens FROM tenant_freed f
                                                WHERE f.tenant_id = t.tenant_id), 0) END
            + CASE WHEN a.action = 'bump' AND t.tenant_id = a.victim_tenant
                   THEN coalesce(a.victim_tenant_tokens, 0) ELSE 0 END,
        refilled_at = CASE WHEN t.tenant_id = a.tenant_id
                                AND (a.t_rpm IS NOT NULL OR a.t_tpm IS NOT NULL)
                           THEN a.now ELSE t.refilled_at END,
        waits = t.waits + CASE WHEN t.tenant_id = a.tenant_id
                                    AND a.action IN ('tenant_wait', 'tenant_book')
                               THEN 1 ELSE 0 END
    FROM answer a
    WHERE t.endpoint = a.endpoint
      AND (t.tenant_id = a.tenant_id
           OR t.tenant_id IN (SELECT f.tenant_id FROM tenant_freed f)
           OR (a.action = 'bump' AND t.tenant_id = a.victim_tenant))
),
tenant_booked AS (
    -- Booked on its tenant's buckets: its turn there; its grace after, as a booking's.
    INSERT INTO model_tenant_bookings (endpoint, tenant_id, run_id, tokens, created_at,
                                       ready_at, expires_at)
    SELECT a.endpoint, run.tenant_id, run.id, coalesce(a.t_wanted, 0), a.now, a.tenant_book_at,
           a.tenant_book_at + make_interval(secs => CAST(:booking_grace AS double precision))
    FROM run, answer a
    WHERE a.action = 'tenant_book'
),
tenant_kept AS (
    -- Back at its turn on its tenant's buckets: the booking is spent when the endpoint takes
    -- the call (its share passes to the reservation or the endpoint's booking); kept through
    -- a pause, until the pause's end and its grace after.
    DELETE FROM model_tenant_bookings k
    USING answer a
    WHERE k.id = a.own_tenant_id AND a.tenant_state = 'due'
      AND a.action IN ('grant', 'bump', 'book')
),
tenant_extended AS (
    UPDATE model_tenant_bookings k
    SET expires_at = greatest(k.expires_at,
                              a.paused_until
                              + make_interval(secs => CAST(:booking_grace AS double precision)))
    FROM answer a
    WHERE k.id = a.own_tenant_id AND a.action = 'wait' AND a.paused
),
held AS (
    INSERT INTO model_reservations (endpoint, run_id, epoch, tokens, created_at, expires_at,
                                    ready_requests_at, ready_tokens_at, wake_at, band,
                                    tenant_id, tenant_tokens)
    SELECT a.endpoint, run.id, run.lease_epoch, coalesce(a.wanted, CAST(:tokens AS integer)),
           a.now,
           CASE WHEN a.action = 'grant'
                THEN a.now + make_interval(secs => CAST(:hold_seconds AS double precision))
                ELSE a.book_wake_at
                     + make_interval(secs => CAST(:booking_grace AS double precision)) END,
           CASE WHEN a.action = 'book' THEN a.book_requests_at END,
           CASE WHEN a.action = 'book' THEN a.book_tokens_at END,
           CASE WHEN a.action = 'book' THEN a.book_wake_at END,
           -- Its run's class, a call in flight's too (the interactive CTE looks for them).
           a.band,
           run.tenant_id, a.tenant_tokens
    FROM run, answer a
    WHERE a.action IN ('grant', 'book')
    RETURNING id, tokens, wake_at, tenant_tokens
),
converted AS (
    UPDATE model_reservations m
    SET epoch = :epoch, tokens = greatest(m.tokens, coalesce(a.wanted, 0)), created_at = a.now,
        expires_at = a.now + make_interval(secs => CAST(:hold_seconds AS double precision)),
        ready_requests_at = NULL, ready_tokens_at = NULL, wake_at = NULL
    FROM answer a
    -- Still this run's booking: the snapshot that found it predates the endpoint's row lock,
    -- and a bump committed meanwhile may have given it to another run.
    WHERE m.id = a.own_id AND a.action = 'convert'
      AND m.run_id = :run_id AND m.wake_at IS NOT NULL
    RETURNING m.id, m.tokens, m.tenant_tokens
),
extended AS (
    -- Told to wait for its own booking's turn (or a pause's end): the booking is kept until
    -- then and its grace after, so the run does not lose its turn to an expiry while it waits
    -- as told.
    UPDATE model_reservations m
    SET expires_at = greatest(m.expires_at,
                              a.ready_at
                              + make_interval(secs => CAST(:booking_grace AS double precision)))
    FROM answer a
    WHERE m.id = a.own_id AND a.action = 'wait' AND a.ready_at IS NOT NULL
      AND m.run_id = :run_id
),
bumped AS (
    UPDATE model_reservations m
    SET run_id = :run_id, epoch = :epoch, band = a.band, tenant_id = a.tenant_id,
        tenant_tokens = a.tenant_tokens
    FROM answer a
    WHERE m.id = a.victim_id AND a.action = 'bump'
)
SELECT a.granted, a.short_of, a.action,
       CAST(CASE WHEN a.granted THEN 0
                 ELSE greatest(extract(epoch FROM a.ready_at - a.now), 0) END
            AS double precision) AS wait_seconds,
       CASE WHEN a.granted THEN a.now ELSE greatest(a.ready_at, a.now) END AS ready_at,
       coalesce((SELECT id FROM held WHERE wake_at IS NULL), (SELECT id FROM converted))
           AS reservation_id,
       coalesce((SELECT tokens FROM held WHERE wake_at IS NULL),
                (SELECT tokens FROM converted)) AS tokens,
       coalesce((SELECT tenant_tokens FROM held WHERE wake_at IS NULL),
                (SELECT tenant_tokens FROM converted)) AS tenant_tokens,
       a.tenant_id, a.rpm, a.tpm
FROM answer a;


-- name: model_budget_count
-- The calls and tokens a process settled on an endpoint's unlimited path since it last asked
-- (ModelBudgets._unlimited), added to the endpoint's figures: the only place they are
-- counted. Sent first in its transaction (model_tenant_count next): every statement that
-- locks an endpoint's row and its tenants' takes the endpoint's first.
INSERT INTO model_budgets AS b (endpoint, requests_used, tokens_used, updated_at)
VALUES (:endpoint, CAST(:requests AS bigint), CAST(:tokens AS bigint), {{now}})
ON CONFLICT (endpoint) DO UPDATE
SET requests_used = b.requests_used + excluded.requests_used,
    tokens_used = b.tokens_used + excluded.tokens_used;


-- name: model_tenant_count
-- The same calls and tokens added to the tenant's figures on the endpoint.
INSERT INTO model_tenant_budgets AS t (endpoint, tenant_id, requests_used, tokens_used,
                                       updated_at)
VALUES (:endpoint, :tenant_id, CAST(:requests AS bigint), CAST(:tokens AS bigint), {{now}})
ON CONFLICT (endpoint, tenant_id) DO UPDATE
SET requests_used = t.requests_used + excluded.requests_used,
    tokens_used = t.tokens_used + excluded.tokens_used;


-- name: model_budget_free
-- Whether a call of :tenant_id to :endpoint takes nothing from any budget: neither the
-- endpoint nor the tenant has a limit there (its own, on the endpoint or on every endpoint),
-- the provider stated none, and no 429 pauses it (the caller has checked the service's
-- defaults). It reads and locks nothing: the asking process trusts the answer for a second
-- and skips the reservation's row lock meanwhile (ModelBudgets._unlimited).
SELECT NOT EXISTS (
           SELECT 1 FROM model_budgets b
           WHERE b.endpoint = :endpoint
             AND (b.requests_per_minute IS NOT NULL OR b.tokens_per_minute IS NOT NULL
                  OR b.provider_rpm IS NOT NULL OR b.provider_tpm IS NOT NULL
                  OR b.paused_until > {{now}}))
       AND NOT EXISTS (
           SELECT 1 FROM model_tenant_budgets t
           WHERE t.tenant_id = :tenant_id AND t.endpoint IN (:endpoint, '')
             AND (t.requests_per_minute IS NOT NULL OR t.tokens_per_minute IS NOT NULL))
       AS free;


-- name: model_budget_settle
-- A call's reservation settled with the usage the provider reported (0 tokens for a call the
-- provider refused): the reservation is deleted and the difference given back (or taken, when
-- the call used more than its estimate; the bucket may go below zero, and later calls wait
-- for it). A reservation already reclaimed (the run's lease lapsed meanwhile) gave its tokens
-- back then, so the whole usage is taken now. Not fenced on the run's lease: it records what
-- the provider spent, which no lease decides; it touches no run.
-- What it gives back (or takes) also moves the bookings' clock (token_advance): every booking
-- comes due that much sooner (or later); and the share of its reservation the call used joins
-- the moving average the bookings' wake times count on.
WITH held AS (
    DELETE FROM model_reservations WHERE id = :reservation_id RETURNING tokens, tenant_tokens
),
back AS (
    SELECT coalesce((SELECT tokens FROM held), 0) - CAST(:used_tokens AS integer) AS tokens,
           (SELECT tokens FROM held) AS reserved
)
UPDATE model_budgets b
SET token_level = CASE WHEN b.token_level IS NULL THEN NULL
                       ELSE least(coalesce(b.tokens_per_minute, CAST(:default_tpm AS integer)),
                                  b.provider_tpm,
                                  b.token_level + back.tokens) END,
    -- No budget of tokens any more (an admin lifted it while the call was in flight, or a
    -- process of another setting settles): nothing to bring forward, and no division by it.
    token_advance = b.token_advance
                    + CASE WHEN b.token_level IS NULL
                                OR coalesce(least(coalesce(b.tokens_per_minute,
                                                           CAST(:default_tpm AS integer)),
                                                  b.provider_tpm), 0) <= 0 THEN 0
                           ELSE back.tokens * 60.0
                                / least(coalesce(b.tokens_per_minute,
                                                 CAST(:default_tpm AS integer)),
                                        b.provider_tpm) END,
    used_share = CASE WHEN back.reserved > 0 AND CAST(:used_tokens AS integer) > 0
                      THEN 0.9 * b.used_share
                           + 0.1 * least(1.0, CAST(:used_tokens AS integer)
                                              / CAST(back.reserved AS double precision))
                      ELSE b.used_share END,
    requests_used = b.requests_used + 1,
    tokens_used = b.tokens_used + CAST(:used_tokens AS integer)
FROM back
WHERE b.endpoint = :endpoint
-- What the reservation held of its tenant's tokens, for model_tenant_settle (NULL: none, or
-- reclaimed meanwhile, which gave them back then).
RETURNING b.token_level, (SELECT h.tenant_tokens FROM held h) AS tenant_tokens;


-- name: model_tenant_settle
-- The same settlement on the call's tenant's row, in the same transaction, after the
-- endpoint's row was locked (the order every reservation takes them in): its totals count the
-- call, and its token bucket gets back what the reservation held of it less the usage (or
-- gives more, when the call used more; a bucket without a limit, NULL, stays so). A refill
-- caps the level at a minute's worth.
INSERT INTO model_tenant_budgets AS t (endpoint, tenant_id, requests_used, tokens_used,
                                       updated_at)
VALUES (:endpoint, :tenant_id, 1, CAST(:used_tokens AS integer), {{now}})
ON CONFLICT (endpoint, tenant_id) DO UPDATE
SET token_level = t.token_level + coalesce(CAST(:tenant_tokens AS integer), 0)
                  - CAST(:used_tokens AS integer),
    requests_used = t.requests_used + 1,
    tokens_used = t.tokens_used + excluded.tokens_used;


-- name: model_tenant_budget_set
-- An admin's limits of one tenant on one endpoint (or, endpoint '', on every endpoint), in
-- one upsert (NULL: no limit of its own there). A `keep_*` flag leaves that column as it is
-- (a CLI flag not given). The next reservation in every process reads them; the buckets keep
-- their levels, a lowered limit caps them at the next refill.
INSERT INTO model_tenant_budgets AS t (endpoint, tenant_id, requests_per_minute,
                                       tokens_per_minute, updated_at)
VALUES (:endpoint, :tenant_id, :requests_per_minute, :tokens_per_minute, {{now}})
ON CONFLICT (endpoint, tenant_id) DO UPDATE
SET requests_per_minute = CASE WHEN :keep_rpm THEN t.requests_per_minute
                               ELSE excluded.requests_per_minute END,
    tokens_per_minute = CASE WHEN :keep_tpm THEN t.tokens_per_minute
                             ELSE excluded.tokens_per_minute END,
    updated_at = excluded.updated_at
RETURNING endpoint, tenant_id, requests_per_minute, tokens_per_minute, updated_at;


-- name: model_tenant_limits
-- One tenant's limits and totals on every endpoint it has a row of (its limits on every
-- endpoint as endpoint ''), by endpoint; at most 200.
SELECT t.endpoint, t.tenant_id, t.requests_per_minute, t.tokens_per_minute, t.requests_used,
       t.tokens_used, t.waits, t.updated_at
FROM model_tenant_budgets t
WHERE t.tenant_id = :tenant_id
ORDER BY t.endpoint
LIMIT 200;


-- name: model_budget_wake
-- Bookings whose runs were told to come back later than their turn now is (a settlement gave
-- tokens back, bringing every booking forward; or the wake time counted on fewer coming
-- back): their runs are made eligible at their turn, now or soon, the next :limit turns
-- first, so the tokens given back are spent then rather than when the runs were told. Keeping
-- the next turns' times true at every settlement means the next calls come when the bucket
-- has them even when no call is in flight to settle meanwhile. A queued run's eligibility
-- only (status 'queued', never a leased run's row); the pairs' marks follow
-- (turnstile_mark_work), as an enqueue's do. Its own transaction after the settlement,
-- without the endpoint's row lock: bookings are taken FOR UPDATE SKIP LOCKED, so a
-- reservation converting one meanwhile is stepped over.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
budget AS MATERIALIZED (
    SELECT b.endpoint, b.token_advance FROM model_budgets b WHERE b.endpoint = :endpoint
),
turns AS MATERIALIZED (
    SELECT m.id, m.run_id, m.wake_at,
           greatest(clock.now, m.ready_requests_at,
                    m.ready_tokens_at - make_interval(secs => b.token_advance)) AS turn_at
    FROM model_reservations m, budget b, clock
    WHERE m.endpoint = b.endpoint AND m.wake_at IS NOT NULL AND m.expires_at > clock.now
    ORDER BY m.ready_tokens_at
    LIMIT :limit
    FOR UPDATE OF m SKIP LOCKED
),
early AS MATERIALIZED (
    -- Told later than its turn: by the run's own row, not the booking's wake_at alone (a run
    -- booked a moment ago may not have given its slot back yet; when it does, it is queued
    -- for the time it was told first, and the next settlement finds it so).
    SELECT t.id, t.run_id, t.turn_at
    FROM turns t JOIN runs r ON r.id = t.run_id
    WHERE r.status = 'queued' AND r.scheduled_for > t.turn_at
),
moved AS (
    UPDATE model_reservations m
    SET wake_at = e.turn_at,
        expires_at = e.turn_at + make_interval(secs => CAST(:booking_grace AS double precision))
    FROM early e
    WHERE m.id = e.id AND m.wake_at > e.turn_at
),
woken AS MATERIALIZED (
    UPDATE runs r
    SET scheduled_for = e.turn_at
    FROM early e
    WHERE r.id = e.run_id AND r.status = 'queued' AND r.scheduled_for > e.turn_at
    RETURNING r.tenant_id, r.priority, r.scheduled_for
),
marked AS MATERIALIZED (
    SELECT count(*) AS pairs
    FROM (SELECT w.tenant_id, w.priority / 10 AS band, min(w.scheduled_for) AS first_at
          FROM woken w GROUP BY 1, 2
          -- count rows in key order, as every statement takes them
          ORDER BY 1, 2) AS pairs,
         LATERAL turnstile_mark_work(pairs.tenant_id, CAST(pairs.band AS smallint),
                                     pairs.first_at, (SELECT now FROM clock)) AS m
)
-- One bounded notification wakes the claimers of the woken runs' priorities, as a requeue's.
SELECT (SELECT count(*) FROM woken) AS woken,
       CASE WHEN (SELECT pairs FROM marked) > 0
            THEN pg_notify('turnstile', jsonb_build_object(
                     'work', (SELECT jsonb_agg(DISTINCT priority) FROM woken))::text)
       END AS notified;


-- name: model_budget_observe
-- What a provider's rate-limit headers said with an answer (NULL: not said): its limits
-- become the budget's ceiling (provider_rpm, provider_tpm; the effective rate is the least
-- of them and the configured one), and the requests it says remain lower the request bucket
-- to them, for every process (another client may share the key). Never raises it: calls of
-- ours in flight that the provider has not counted yet are still taken from ours. Not the
-- tokens it says remain: it counts the calls of ours it answered at their usage, ours still
-- at their estimates until they settle, and the settlement's give-back on top of the lowered
-- bucket gave out more than the rate (429s in the burst bench). The buckets are
-- first refilled to now, as a reservation refills them, and refilled_at moved to now: what
-- the provider says remains already counts its refill until now, which the next
-- reservation must not add again.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
budget AS MATERIALIZED (
    SELECT b.endpoint,
           greatest(clock.now, coalesce(b.refilled_at, clock.now)) AS now,
           CASE WHEN rpm IS NOT NULL
                THEN least(rpm, coalesce(b.request_level, rpm) + e.elapsed * rpm / 60.0) END
               AS requests,
           CASE WHEN tpm IS NOT NULL
                THEN least(tpm, coalesce(b.token_level, tpm) + e.elapsed * tpm / 60.0) END
               AS tokens
    FROM model_budgets b, clock,
         LATERAL (SELECT least(coalesce(b.requests_per_minute, CAST(:default_rpm AS integer)),
                               b.provider_rpm) AS rpm,
                         least(coalesce(b.tokens_per_minute, CAST(:default_tpm AS integer)),
                               b.provider_tpm) AS tpm,
                         greatest(extract(epoch FROM clock.now
                                          - coalesce(b.refilled_at, clock.now)), 0)
                             AS elapsed) AS e
    WHERE b.endpoint = :endpoint
    FOR UPDATE OF b
)
UPDATE model_budgets b
SET provider_rpm = coalesce(CAST(:limit_requests AS integer), b.provider_rpm),
    provider_tpm = coalesce(CAST(:limit_tokens AS integer), b.provider_tpm),
    request_level = CASE WHEN CAST(:remaining_requests AS float8) IS NULL THEN d.requests
                         ELSE least(d.requests, CAST(:remaining_requests AS float8)) END,
    token_level = d.tokens,
    refilled_at = d.now,
    observed_at = d.now
FROM budget d
WHERE b.endpoint = d.endpoint
RETURNING b.provider_rpm, b.provider_tpm;


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


-- name: model_budget_tenant_figures
-- Per endpoint and tenant: what its calls hold now, in flight (reserved) and waiting their
-- turn on the endpoint (booked) or on the tenant's own limit (tenant_booked), requests and
-- tokens; what they used (settled) and how often the tenant's limit made one wait; and the
-- tenant's limits there (its own on the endpoint, its own on every endpoint). One bounded
-- scan of the reservations and bookings (one per call in flight or waiting) and of the
-- tenants' rows; at most 1000 pairs, the largest users and holders first.
WITH held AS (
    SELECT m.endpoint, coalesce(m.tenant_id, '') AS tenant_id,
           count(*) FILTER (WHERE m.wake_at IS NULL) AS reservations,
           coalesce(sum(m.tokens) FILTER (WHERE m.wake_at IS NULL), 0) AS reserved_tokens,
           count(*) FILTER (WHERE m.wake_at IS NOT NULL) AS booked,
           coalesce(sum(m.tokens) FILTER (WHERE m.wake_at IS NOT NULL), 0) AS booked_tokens
    FROM model_reservations m
    GROUP BY 1, 2
),
waiting AS (
    SELECT k.endpoint, k.tenant_id, count(*) AS tenant_booked,
           coalesce(sum(k.tokens), 0) AS tenant_booked_tokens
    FROM model_tenant_bookings k
    GROUP BY 1, 2
),
pairs AS (
    -- Every pair that holds, waits or has a row (its limits and totals); not the rows of
    -- endpoint '' (a tenant's limits on every endpoint, joined below).
    SELECT endpoint, tenant_id FROM held
    UNION
    SELECT endpoint, tenant_id FROM waiting
    UNION
    SELECT endpoint, tenant_id FROM model_tenant_budgets WHERE endpoint <> ''
)
SELECT p.endpoint, p.tenant_id,
       coalesce(h.reservations, 0) AS reservations,
       coalesce(h.reserved_tokens, 0) AS reserved_tokens,
       coalesce(h.booked, 0) AS booked, coalesce(h.booked_tokens, 0) AS booked_tokens,
       coalesce(w.tenant_booked, 0) AS tenant_booked,
       coalesce(w.tenant_booked_tokens, 0) AS tenant_booked_tokens,
       coalesce(t.requests_used, 0) AS requests_used, coalesce(t.tokens_used, 0) AS tokens_used,
       coalesce(t.waits, 0) AS tenant_waits,
       t.requests_per_minute, t.tokens_per_minute,
       e.requests_per_minute AS every_requests_per_minute,
       e.tokens_per_minute AS every_tokens_per_minute
FROM pairs p
LEFT JOIN held h ON h.endpoint = p.endpoint AND h.tenant_id = p.tenant_id
LEFT JOIN waiting w ON w.endpoint = p.endpoint AND w.tenant_id = p.tenant_id
LEFT JOIN model_tenant_budgets t ON t.endpoint = p.endpoint AND t.tenant_id = p.tenant_id
LEFT JOIN model_tenant_budgets e ON e.endpoint = '' AND e.tenant_id = p.tenant_id
ORDER BY coalesce(t.tokens_used, 0) + coalesce(h.reserved_tokens, 0)
         + coalesce(h.booked_tokens, 0) + coalesce(w.tenant_booked_tokens, 0) DESC,
         p.endpoint, p.tenant_id
LIMIT 1000;


-- name: model_budget_figures
-- Every endpoint's budget and figures, for the admin's view and the metrics: the overrides,
-- the running totals, the pause, and what open reservations hold now (one bounded scan of
-- the reservations, which are at most one per model call in flight).
SELECT b.endpoint, b.requests_per_minute, b.tokens_per_minute, b.updated_at,
       b.request_level, b.token_level, b.refilled_at, b.paused_until,
       b.requests_used, b.tokens_used, b.waits, b.pauses, b.provider_rpm, b.provider_tpm,
       coalesce(m.reservations, 0) AS reservations, coalesce(m.tokens, 0) AS reserved_tokens,
       coalesce(m.booked, 0) AS booked, coalesce(m.booked_tokens, 0) AS booked_tokens
FROM model_budgets b
LEFT JOIN (SELECT endpoint,
                  count(*) FILTER (WHERE wake_at IS NULL) AS reservations,
                  sum(tokens) FILTER (WHERE wake_at IS NULL) AS tokens,
                  count(*) FILTER (WHERE wake_at IS NOT NULL) AS booked,
                  sum(tokens) FILTER (WHERE wake_at IS NOT NULL) AS booked_tokens
           FROM model_reservations GROUP BY endpoint) AS m ON m.endpoint = b.endpoint
WHERE CAST(:endpoint AS text) IS NULL OR b.endpoint = :endpoint
ORDER BY b.endpoint
LIMIT 200;
