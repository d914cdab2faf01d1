CREATE OR REPLACE FUNCTION turnstile_clear_work(p_tenant text, p_band smallint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
-- For the release before migration 0016 only, whose claims offer a pair they drained here:
-- turnstile_settle_work, on the database's clock. Dropped by the migration that contracts
-- 0016.
BEGIN
    RETURN turnstile_settle_work(p_tenant, p_band, now());
END
$fn$;
