"""The client's connection to a trunk server: auth, retries with backoff, byte counting.

A call that fails because the server cannot be reached (UNAVAILABLE: restarting, network blip)
is retried with exponential backoff until `reconnect_timeout`; every RPC is safe to repeat (see
the server's rules). When the server answers NOT_FOUND for our session, it has restarted and
forgotten us: `SessionLost` tells the trainer to roll both sides back to a shared checkpoint.
Other failures become a `SmolforgeError` that says what to fix.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

import grpc

from smolforge.errors import SmolforgeError
from smolforge.split.protocol import bearer, channel, pb, pb_grpc

log = logging.getLogger("smolforge.split.client")
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Reconnect quickly after a server restart (gRPC's default backoff grows to two minutes).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


NOTIFY_EVERY = 30.0  # seconds between "still waiting" lines while the server cannot be reached


def _to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class SessionLost(Exception):
    """The server no longer knows our session (it restarted, or the session timed out)."""


class TrunkCallError(SmolforgeError):
    """A trunk server call failed for a reason retrying will not fix; `.code` is the gRPC status."""

    def __init__(self, what: str, code: grpc.StatusCode, fix: str | None = None, where: str | None = None):
        self.code = code
        super().__init__(what, where=where, fix=fix)


_FIXES = {
    grpc.StatusCode.UNAUTHENTICATED: "pass the server's token with --token-file F (or set SMOLFORGE_SPLIT_TOKEN)",
    grpc.StatusCode.FAILED_PRECONDITION: "start the client with the same model and split points as the server",
    grpc.StatusCode.INVALID_ARGUMENT: "this is a client/server mismatch; use the same smolforge version on both",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "wait for other sessions to finish, or raise --max-sessions on the server",
}


class TrunkClient:
    def __init__(self, host: str, port: int, token: str | None = None, tls_ca: str | None = None,
                 server_name: str | None = None, rpc_timeout: float = 600.0, reconnect_timeout: float = 300.0,
                 notify: Callable[[str], None] | None = None):
        """A channel to the trunk server at host:port. `notify(line)` hears that the server cannot be
        reached, while the client retries (default: a line on stderr); seconds are wall-clock limits."""
        self.address = f"{host}:{port}"
        self.tls = bool(tls_ca)
        self._channel = channel(host, port, tls_ca, server_name, extra_options=RECONNECT_OPTIONS)
        self.stub = pb_grpc.TrunkStub(self._channel)
        self.metadata = bearer(token) if token else ()
        self.rpc_timeout = rpc_timeout
        self.reconnect_timeout = reconnect_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self.retries = 0
        self.notify = notify or _to_stderr
        self._unreachable_since: float | None = None
        self._last_notice = 0.0

    def call(self, name: str, request, *, retry: bool = True, timeout: float | None = None):
        """Call RPC `name`; retries while the server is unreachable; raises SessionLost or TrunkCallError."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.2
        while True:
            try:
                reply = getattr(self.stub, name)(request, metadata=self.metadata, timeout=timeout or self.rpc_timeout)
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                details = err.details() if hasattr(err, "details") else str(err)
                if code in RETRY_CODES and retry and time.monotonic() + delay < deadline:
                    self.retries += 1
                    self._waiting(name, code, details, deadline)
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if code == grpc.StatusCode.NOT_FOUND:
                    raise SessionLost(details) from None
                if code in RETRY_CODES:
                    raise TrunkCallError(
                        f"cannot reach the trunk server at {self.address} ({code.name}: {details})", code,
                        fix="start it with `smolforge split serve ...`, check --server-host/--server-port, "
                        "and use --tls-ca exactly when the server has TLS") from None
                raise TrunkCallError(f"trunk server refused {name}: {code.name}: {details}", code,
                                     fix=_FIXES.get(code)) from None
            if self._unreachable_since is not None:
                self.notify(f"the trunk server at {self.address} answers again ({name})")
                self._unreachable_since = None
            self.bytes_sent += request.ByteSize()
            self.bytes_received += reply.ByteSize()
            return reply

    def _waiting(self, name: str, code: grpc.StatusCode, details: str, deadline: float) -> None:
        """Say at once that the server cannot be reached and what the client waits for; then again every
        NOTIFY_EVERY seconds while it waits (never silently for `reconnect_timeout`)."""
        now = time.monotonic()
        left = max(0.0, deadline - now)
        if self._unreachable_since is None:
            self._unreachable_since = self._last_notice = now
            self.notify(f"cannot reach the trunk server at {self.address} ({code.name}: {details}); retrying "
                        f"{name} for up to {left:.0f} s, waiting for `smolforge split serve` to listen there "
                        "(check --server-host/--server-port; Ctrl-C stops)")
        elif now - self._last_notice >= NOTIFY_EVERY:
            self._last_notice = now
            self.notify(f"still waiting for the trunk server at {self.address} ({code.name}), "
                        f"{now - self._unreachable_since:.0f} s so far, {left:.0f} s left")

    def info(self, session_name: str = "", retry: bool = True) -> pb.InfoReply:
        return self.call("Info", pb.InfoRequest(session_name=session_name), retry=retry)

    def health(self, timeout: float = 5.0) -> bool:
        try:
            return self.stub.Health(pb.HealthRequest(), timeout=timeout).status == "ok"
        except grpc.RpcError:
            return False

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TrunkClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
