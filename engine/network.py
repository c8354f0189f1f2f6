"""Which addresses are this machine's alone: the one loopback test every listener shares.

The server's bind check, its ``Host`` allow-list, the Ray it starts for a
loopback service and a training rendezvous at a loopback main address all
ask the same question; it is answered here, once. Standard library only.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, ``127.x``, ``::1`` (bracketed or
    not) or an IPv4-mapped loopback; other names are not assumed to be (nothing is resolved)."""
    text = host.strip().strip("[]").lower()
    if text == "localhost":
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it): where a local server or a group of
    ranks listens."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
