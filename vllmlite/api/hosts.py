"""Which Host headers the server answers: loopback names, the address it listens on, and what the
operator adds (--allowed-hosts), as vLLM, Jupyter and llama.cpp check them.

A page on another site can point a name it controls at 127.0.0.1 (DNS rebinding): its requests then
reach a local server as same-origin, with that name in Host. Refusing unknown names closes this; an
IP literal cannot be rebound, so a server listening on every interface (0.0.0.0, ::) accepts any.
Knows nothing of HTTP beyond the header's text.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

LOOPBACK_NAMES = ("localhost",)
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})
ANY_HOST = "*"
_HOST = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^\[\]:]*)(:\d*)?")  # name or [IPv6], then an optional :port


def host_name(header: str) -> str | None:
    """The name or address in a Host header, lowercase, without port, brackets or a final dot; None
    if it is malformed.

    >>> host_name("LocalHost.:8000"), host_name("[::1]:80"), host_name("127.0.0.1"), host_name("a:b:c")
    ('localhost', '::1', '127.0.0.1', None)
    """
    match = _HOST.fullmatch(header.strip())
    if match is None:
        return None
    return match.group(1).strip("[]").lower().rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostPolicy:
    """The Host values a server listening on `bound_host` accepts: loopback names and addresses,
    `bound_host`, every IP address when `bound_host` is a wildcard, and `allowed` ('*': anything).

    >>> policy = HostPolicy("127.0.0.1", ["my.server.example"])
    >>> [policy.allows(h) for h in ("localhost:8000", "127.0.0.1", "[::1]", "my.server.example", "evil.example")]
    [True, True, True, True, False]
    >>> HostPolicy("0.0.0.0", []).allows("192.168.1.20:8000"), HostPolicy("0.0.0.0", []).allows("evil.example")
    (True, False)
    """

    def __init__(self, bound_host: str, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        self.allows_any = ANY_HOST in allowed
        self.allows_any_ip = bound_host in WILDCARD_ADDRESSES
        self.names = frozenset(name for name in (host_name(h) for h in (*LOOPBACK_NAMES, bound_host, *allowed)
                                                 if h != ANY_HOST) if name)

    def allows(self, header: str | None) -> bool:
        """Whether a request with this Host header is answered (no header: HTTP/1.0, not a browser)."""
        if header is None or self.allows_any:
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in self.names:
            return True
        address = _ip(name)
        return address is not None and (address.is_loopback or self.allows_any_ip)
