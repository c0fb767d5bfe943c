"""The wire protocol: generated stubs, message limits, auth metadata and transport credentials.

Both ends import this module, so the limits and the auth header are defined once. Importing it
makes sure the stubs generated from `split.proto` are current (see `gen_proto.py`).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from smolforge.errors import SmolforgeError
from smolforge.split.gen_proto import ensure_generated

ensure_generated()

from smolforge.split._generated import split_pb2 as pb  # noqa: E402
from smolforge.split._generated import split_pb2_grpc as pb_grpc  # noqa: E402

PROTOCOL_VERSION = "1"
# gRPC refuses messages over 4 MiB by default; one micro-batch of hidden states is easily more
# (batch 8 x 1024 tokens x 896 hidden x fp32 = 29 MiB). Both ends raise the limit to 1 GiB.
MAX_MESSAGE_BYTES = 1 << 30
AUTH_HEADER = "authorization"
TOKEN_ENV = "SMOLFORGE_SPLIT_TOKEN"
# Calls that work without a token: liveness probes need no secret and reveal nothing.
OPEN_METHODS = ("/smolforge.split.v1.Trunk/Health",)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A server's: gRPC sets SO_REUSEPORT by default, so a second trunk on a used port would start and take a
# share of the connections; without it, binding a used port fails ("address already in use").
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def bearer(token: str) -> tuple[tuple[str, str]]:
    """Call metadata carrying the token."""
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _read(path: str | Path, what: str, flag: str) -> bytes:
    path = Path(path).expanduser()
    if not path.is_file():
        raise SmolforgeError(f"{what} file {path} does not exist", fix=f"check the {flag} path")
    return path.read_bytes()


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials for `serve`, or None for plaintext (both files or neither)."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise SmolforgeError("TLS needs both a certificate and its key",
                             fix="pass --tls-cert server.pem --tls-key server.key (or neither for plaintext)")
    pair = (_read(key, "TLS key", "--tls-key"), _read(cert, "TLS certificate", "--tls-cert"))
    return grpc.ssl_server_credentials([pair])


def channel(host: str, port: int, tls_ca: str | None = None, server_name: str | None = None,
            extra_options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A channel with the raised limits; TLS when a CA bundle is given (it verifies the server)."""
    target = f"{host}:{port}"
    options = list(CHANNEL_OPTIONS) + list(extra_options or [])
    if tls_ca:
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "TLS CA", "--tls-ca"))
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


__all__ = ["pb", "pb_grpc", "MAX_MESSAGE_BYTES", "CHANNEL_OPTIONS", "AUTH_HEADER", "TOKEN_ENV", "bearer",
           "server_credentials", "channel", "PROTOCOL_VERSION", "OPEN_METHODS"]
