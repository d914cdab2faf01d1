CREATE OR REPLACE FUNCTION turnstile_add_queued(p_tenant text, p_band smallint, p_n bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
-- For the release before migration 0016 only, which calls it after inserting queued runs
-- (its enqueues, ticks and submissions): they are marked as work to claim now, whatever their
-- time (that release does not say it), and the next settle gives a pair whose runs are all
-- later its due time. The striped counts it used to keep are no longer read by anything.
-- Dropped by the migration that contracts 0016.
BEGIN
    PERFORM turnstile_mark_work(p_tenant, p_band, now(), now());
END
$fn$;
