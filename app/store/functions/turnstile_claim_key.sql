CREATE OR REPLACE FUNCTION turnstile_claim_key(
    p_now timestamptz,        -- NULL: now()
    p_tenant text,
    p_principal text,
    p_key text,
    p_request_hash text,
    p_ttl_seconds double precision
)
RETURNS boolean
LANGUAGE sql VOLATILE AS $fn$
-- Takes an Idempotency-Key for this request (ADR-0004 decision 9), the one place a key is
-- claimed: true when taken, false when the key is someone's already (the caller reads the
-- stored outcome: a replay, or a reuse with another request hash). A concurrent twin's
-- uncommitted insert makes this wait on the unique index (the caller bounds it with its
-- lock_timeout), then see its committed row. An expired key not pruned yet counts as absent:
-- it is taken over.
    WITH taken AS (
        INSERT INTO idempotency_keys AS k (tenant_id, principal, key, request_hash,
                                           response_status, response_body, created_at,
                                           expires_at)
        VALUES (p_tenant, p_principal, p_key, p_request_hash, 0, '{}'::jsonb,
                coalesce(p_now, now()),
                coalesce(p_now, now()) + make_interval(secs => p_ttl_seconds))
        ON CONFLICT (tenant_id, principal, key) DO UPDATE
        SET request_hash = excluded.request_hash,
            response_status = 0,
            response_body = '{}'::jsonb,
            run_id = NULL,
            created_at = excluded.created_at,
            expires_at = excluded.expires_at
        WHERE k.expires_at <= coalesce(p_now, now())
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM taken)
$fn$;
