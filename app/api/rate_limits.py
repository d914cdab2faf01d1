"""The RateLimit header fields of the two submission routes (`POST /runs`,
`POST /sessions/{id}/turns`), as draft-ietf-httpapi-ratelimit-headers-11 (May 2026) spells
them: Structured Field lists of one item each, the policy named "submit".

    RateLimit-Policy: "submit";q=10;w=5     a bucket of 10 submissions that refills in 5 s
    RateLimit: "submit";r=3;t=1             3 submissions allowed now; 1 s to the next token

`q` is the burst (the bucket's size) and `w` the time an empty bucket takes to fill, rounded
up to whole seconds (the draft has no sub-second windows): on average `q / w` submissions a
second, which is the rate rounded down where it is not a whole fraction. `r` is the whole
tokens left after this request (0 on a 429), `t` the seconds until one more (left out when the
bucket is full); on a 429 `Retry-After` equals `t`, as the draft asks (section 6). No partition
key: the bucket is the API key's tenant's, which the caller knows. A tenant with no rate limit
gets neither field. Which answers carry them: app/queue/submit.py (every outcome of a
submission, refusals included; not requests refused before it, such as 401 or 422).
"""

from __future__ import annotations

from app.vocabulary.records import SubmitAllowance

DRAFT = "draft-ietf-httpapi-ratelimit-headers-11"
POLICY = "submit"


def rate_limit_headers(allowance: SubmitAllowance | None) -> dict[str, str]:
    """`RateLimit-Policy` and `RateLimit` for a submission's answer (none without a limit)."""
    if allowance is None:
        return {}
    policy = f'"{POLICY}";q={allowance.burst};w={allowance.window_seconds}'
    limit = f'"{POLICY}";r={allowance.remaining}'
    if (seconds := allowance.next_token_seconds) is not None:
        limit += f";t={seconds}"
    return {"RateLimit-Policy": policy, "RateLimit": limit}
