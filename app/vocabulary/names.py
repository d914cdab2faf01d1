"""Tenant and principal names: the one place that validates and normalises them.

Every path that takes a name goes through `tenant_name` and `principal_name`: API keys
(`turnstile keys create`, the development key), the tenants' limits (`/tenants/{tenant}/limits`,
`turnstile tenants`), and every `--tenant` and `--principal` of the command line. Requests
authenticated by a key carry its names, checked when the key was made. The Python queue API
(`Queue.enqueue`, for back-end services inside the deployment) takes names as it is given them,
so that runs of a tenant named before these rules keep their tenant (a resubmission, say); a
program that takes names from people calls `tenant_name` first.

A name is normalised, then checked:
- NFKC, the compatibility normal form: look-alikes that Unicode itself maps to plain letters
  become them (`acme` in fullwidth letters, U+FF41 U+FF43 U+FF4D U+FF45, is `acme`), so one
  tenant cannot be spelled two ways;
- whitespace at either end is dropped;
- 1 to `MAX_NAME_LENGTH` characters (the length the API's paths take), counted after NFKC,
  which can lengthen a name;
- no invisible or unprintable characters: control (`\\x00`, `\\x07`), format (zero-width spaces
  and joiners, bidirectional controls, the byte order mark), surrogate, private-use and
  unassigned characters, line and paragraph separators, and no whitespace but the plain space.
  Two names that read the same would otherwise be two tenants.

Not caught: letters of another script drawn alike (Cyrillic a, U+0430, for Latin a). Unicode's
confusable skeletons (UTS #39) would catch them, at the price of its data tables; names are
given by operators, not chosen by the tenants themselves.
"""

from __future__ import annotations

import unicodedata

MAX_NAME_LENGTH = 255
# General categories refused anywhere in a name, with how an error message calls them.
_REFUSED_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible format character",
    "Cs": "a lone surrogate",
    "Co": "a private-use character",
    "Cn": "an unassigned character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Zs": "a space other than U+0020",
}


class InvalidNameError(ValueError):
    """A name refused; `what` is `tenant` or `principal`, `reason` says why."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason


def tenant_name(value: str) -> str:
    """The tenant name `value` normalises to; InvalidNameError when it cannot be one."""
    return _normalised("tenant", value)


def principal_name(value: str) -> str:
    """The principal name `value` normalises to; InvalidNameError when it cannot be one."""
    return _normalised("principal", value)


def _normalised(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(what, "must be text")
    name = unicodedata.normalize("NFKC", value).strip()
    if not name:
        raise InvalidNameError(what, "must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidNameError(what, f"must be at most {MAX_NAME_LENGTH} characters")
    for char in name:
        kind = _REFUSED_CATEGORIES.get(unicodedata.category(char))
        if kind is not None and char != " ":
            raise InvalidNameError(
                what,
                f"must not contain invisible or control characters (U+{ord(char):04X}, {kind})",
            )
    return name
