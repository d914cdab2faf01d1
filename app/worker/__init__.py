"""The worker pool: slot groups with reserved capacity per class (ADR-0004 decision 2), wakeups
by LISTEN/NOTIFY, batched heartbeats, self-fencing and graceful drain. The same pool runs inside
`turnstile serve` (started by the FastAPI lifespan) and in `turnstile worker` processes."""
