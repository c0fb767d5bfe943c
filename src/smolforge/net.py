"""Small facts about addresses that every service needs (a leaf: imports nothing of ours)."""

from __future__ import annotations

import ipaddress

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """True for names and addresses that only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def why_unbindable(host: str, port: int) -> str | None:
    """Why a server cannot listen on `host:port`, asked of the OS by binding it once; None when it can.

    "address already in use" (a listener holds it: it refuses even with SO_REUSEADDR, which lets a port
    in TIME_WAIT pass), "<host> is not an address of this machine", "the host ... cannot be resolved",
    else the OS's own words. For the one message a listener's refusal gives (gRPC says "failed to bind")."""
    import errno
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        return None
    except (socket.gaierror, UnicodeError) as err:
        return f"the host {host!r} cannot be resolved ({getattr(err, 'strerror', None) or err})"
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return "address already in use"
        if err.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this machine"
        return err.strerror or str(err)
