CREATE OR REPLACE FUNCTION turnstile_add_queued(p_tenant text, p_band smallint, p_n bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
-- The enqueue's side of the striped count (docs/adr/0006, "Striped queued counts"): p_n new
-- queued runs of (p_tenant, p_band), written by the caller's statement or transaction. Each
-- statement below runs on a snapshot of its own (READ COMMITTED), in this order:
BEGIN
    -- 1. A first run of the (tenant, band): the count row, then its 8 stripes, in this
    --    transaction, so they commit together. Row first, as count_moves creates them: a
    --    concurrent creator then waits on the row and never holds a stripe this one needs.
    --    ON CONFLICT DO NOTHING: a concurrent first run may have created them meanwhile.
    IF NOT EXISTS (SELECT 1 FROM tenant_class_counts c
                   WHERE c.tenant_id = p_tenant AND c.band = p_band) THEN
        INSERT INTO tenant_class_counts (tenant_id, band, running, queued, has_work)
        VALUES (p_tenant, p_band, 0, 0, true)
        ON CONFLICT (tenant_id, band) DO NOTHING;
        INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
        SELECT p_tenant, p_band, g, 0 FROM generate_series(0, 7) AS g
        ON CONFLICT (tenant_id, band, stripe) DO NOTHING;
    END IF;
    -- 2. The runs, on this connection's stripe: concurrent enqueues of one tenant from other
    --    connections update other rows. The stripe stays locked to the commit.
    INSERT INTO tenant_queued_stripes AS s (tenant_id, band, stripe, queued)
    VALUES (p_tenant, p_band, pg_backend_pid() % 8, p_n)
    ON CONFLICT (tenant_id, band, stripe) DO UPDATE SET queued = s.queued + excluded.queued;
    -- 3. The mark, on a snapshot taken after step 2. A clear committed before it is seen here
    --    (has_work false: set it again); a clear that has not committed by now cannot happen,
    --    because it needs all 8 stripes and this transaction holds one (turnstile_clear_work).
    --    A no-op (no lock, no write) while the flag is already set: the common case.
    UPDATE tenant_class_counts c SET has_work = true
    WHERE c.tenant_id = p_tenant AND c.band = p_band AND NOT c.has_work;
END
$fn$
