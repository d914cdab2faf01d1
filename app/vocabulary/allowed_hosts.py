"""The outbound allow-list's entries (TURNSTILE_HTTP_ALLOWED_HOSTS): how one is written and what
it names. Pure, so the settings can refuse a malformed entry at start and the `http_request`
tool (app/runtime/http_tool.py) can apply the same entries, without the settings importing the
runtime.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class AllowedHost:
    """One entry of the allow-list: a name, `*.suffix`, `*`, or a literal `address`; `port`
    None allows every port."""

    host: str
    port: int | None
    address: IPAddress | None

    def names(self, host: str, literal: IPAddress | None) -> bool:
        """Whether this entry names `host` (whose address is `literal` when it is one)."""
        if self.address is not None:
            return literal == self.address
        if self.host in ("*", host):
            return True
        return self.host.startswith("*.") and host.endswith(self.host[1:])


def parse_allowed(entry: str) -> AllowedHost:
    """An allow-list entry: `host`, `host:port`, `[IPv6]` or `[IPv6]:port` (a bare IPv6 address,
    several colons, has no port). ValueError says what is wrong with a malformed one."""
    text = entry.strip().lower()
    port: str | None = None
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"allow-list entry {entry!r}: write an IPv6 address as [addr]:port")
        host, port = inside, (rest[1:] if rest else None)
        if literal_address(host) is None:
            raise ValueError(f"allow-list entry {entry!r}: {host!r} is not an IPv6 address")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host = text
    if not host:
        raise ValueError(f"allow-list entry {entry!r} names no host")
    return AllowedHost(host=host, port=_allowed_port(entry, port), address=literal_address(host))


def _allowed_port(entry: str, port: str | None) -> int | None:
    if port is None:
        return None
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"allow-list entry {entry!r}: the port must be a number from 1 to 65535")
    return int(port)


def literal_address(entry: str) -> IPAddress | None:
    """The address an allow-list entry names literally (`10.0.0.1`, `[fd00::1]`), if any."""
    try:
        return ipaddress.ip_address(entry.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
