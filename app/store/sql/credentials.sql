-- The credentials' statements, sent by app/store/access.py: dashboard sign-in sessions
-- (app/security/dashboard_sessions.py). A session's cookie holds a random token; only its
-- SHA-256 is stored, with the key it belongs to. API keys: app/security/api_keys.py.

-- name: session_start
-- Sign-in in one statement: the key must exist and be unrevoked, or nothing is inserted.
-- Expired sessions (anyone's) are deleted on the way: sign-ins are rare, the index is on
-- expires_at, and the table then never outgrows the sessions that are still open.
WITH clock AS MATERIALIZED (SELECT {{now}} AS now),
pruned AS (
    DELETE FROM dashboard_sessions d USING clock WHERE d.expires_at <= clock.now
),
opened AS (
    INSERT INTO dashboard_sessions (token_hash, key_id, created_at, expires_at)
    SELECT :token_hash, k.id, clock.now, clock.now + make_interval(secs => :lifetime_seconds)
    FROM api_keys k, clock
    WHERE k.key_hash = :key_hash AND k.revoked_at IS NULL
    RETURNING key_id
)
SELECT k.id, k.tenant_id, k.principal, k.scopes
FROM opened JOIN api_keys k ON k.id = opened.key_id;


-- name: session_caller
-- Every dashboard request: the session's key, if the session is unexpired and the key
-- unrevoked. No cache: signing out or revoking takes effect on the next request, everywhere.
SELECT k.id, k.tenant_id, k.principal, k.scopes
FROM dashboard_sessions d
JOIN api_keys k ON k.id = d.key_id
WHERE d.token_hash = :token_hash AND d.expires_at > {{now}} AND k.revoked_at IS NULL;


-- name: session_end
DELETE FROM dashboard_sessions WHERE token_hash = :token_hash;


-- API keys (app/security/api_keys.py): random secrets shown once, stored as SHA-256 hashes (a
-- slow password hash would make every request slow).

-- name: key_create
INSERT INTO api_keys (key_hash, prefix, tenant_id, principal, scopes, name, created_at)
VALUES (:hash, :prefix, :tenant, :principal, :scopes, :name, {{now}})
RETURNING id, prefix, tenant_id, principal, scopes, name, created_at, revoked_at;


-- name: key_authenticate
SELECT id, tenant_id, principal, scopes FROM api_keys
WHERE key_hash = :hash AND revoked_at IS NULL;


-- name: keys_active
-- Which of these keys are still unrevoked: the API's periodic check of the keys that hold
-- event streams and long polls open (app/api/watch.py, KeyRecheck), one statement for all of
-- them. A key deleted outright is as gone as a revoked one.
SELECT id FROM api_keys WHERE id = ANY(CAST(:ids AS uuid[])) AND revoked_at IS NULL;


-- name: key_list
SELECT id, prefix, tenant_id, principal, scopes, name, created_at, revoked_at
FROM api_keys
WHERE CAST(:tenant AS text) IS NULL OR tenant_id = :tenant
ORDER BY created_at;


-- name: key_revoke
-- Revoking ends the key's dashboard sessions too: session lookups also require an unrevoked
-- key, and deleting the rows keeps nothing behind.
WITH revoked AS (
    UPDATE api_keys SET revoked_at = {{now}}
    WHERE id = :id AND revoked_at IS NULL
    RETURNING id
),
ended AS (
    DELETE FROM dashboard_sessions WHERE key_id = :id
)
SELECT id FROM revoked;


-- name: key_any
SELECT EXISTS (SELECT 1 FROM api_keys) AS any_key;
