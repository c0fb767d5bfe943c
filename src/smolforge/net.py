"""Small facts about addresses that every service needs (a leaf: imports only `errors`)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smolforge.errors import SmolforgeError

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


def bind_refusal(host: str, port: int, flag: str = "--port", what: str = "cannot listen") -> "SmolforgeError | None":
    """The one message for a listener that cannot bind `host:port` (`why_unbindable`'s reason, never a
    guess): "address already in use" names the port, an address that is not this machine's names --host.
    None when it can bind. Every listener asks this (coordinator, dashboard, serve, the split trunk)."""
    from smolforge.errors import SmolforgeError

    why = why_unbindable(host or "0.0.0.0", port)
    if why is None:
        return None
    if why == "address already in use":
        return SmolforgeError(f"{what} on {host}:{port}: address already in use", where=flag,
                              fix=f"pick a free {flag} (0 picks one where the command allows it), or stop what "
                                  f"is listening on {port}")
    return SmolforgeError(f"{what} on {host}:{port}: {why}", where="--host",
                          fix="give --host an address of this machine (127.0.0.1, 0.0.0.0, or a LAN address it has)")
