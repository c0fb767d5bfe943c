"""TLS for the coordinator's API: a self-signed certificate made once, pinned by its fingerprint.

Why pinning and not a CA: a home cluster has no certificate authority and no DNS names, only IP
addresses that change with the Wi-Fi. `coordinator start --tls` makes one certificate (kept in the
state dir, key 0600) and prints its SHA-256 fingerprint in the join command. A client fetches the
server's certificate, checks that its fingerprint is the pinned one (constant time), and then trusts
exactly that certificate for the real connection; a certificate with any other fingerprint is
refused before a token is sent. Host names are not checked: the pin already names the one
certificate that may answer, whatever address reaches it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_write_bytes, private_dir

FINGERPRINT_ENV = "SMOLFORGE_TLS_FINGERPRINT"


def fingerprint(pem: str) -> str:
    """`sha256:<hex>` of the certificate's DER bytes (what `openssl x509 -fingerprint -sha256` shows)."""
    return "sha256:" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def normalise_fingerprint(text: str) -> str:
    """Accept `sha256:ab12…`, `AB:12:…` (openssl's form) or bare hex; return `sha256:<hex>`."""
    raw = text.strip().lower().removeprefix("sha256:").removeprefix("sha256 fingerprint=").replace(":", "")
    if len(raw) != 64 or any(c not in "0123456789abcdef" for c in raw):
        raise SmolforgeError(f"{text!r} is not a SHA-256 certificate fingerprint",
                             fix="copy the --tls-fingerprint value that `smolforge coordinator start --tls` printed")
    return "sha256:" + raw


def ensure_cert(state_root: Path, hosts: list[str]) -> tuple[Path, Path]:
    """The coordinator's certificate and key under `<state>/tls/`, made on first use (key 0600).

    Its names list every address given (and localhost), so browsers and tools that do check names
    work when they are told to trust it; our own clients pin the fingerprint instead."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir = private_dir(Path(state_root) / "tls")
    cert_path, key_path = tls_dir / "cert.pem", tls_dir / "key.pem"
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smolforge coordinator")])
    alt: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    for h in {*hosts, "127.0.0.1"}:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def trust_exactly(pem: str) -> ssl.SSLContext:
    """A client context that trusts this one certificate and nothing else (names unchecked)."""
    ctx = ssl.create_default_context(cadata=pem)
    ctx.check_hostname = False
    return ctx


def pinned_context(host: str, port: int, pinned: str, timeout: float = 10.0) -> ssl.SSLContext:
    """Fetch the server's certificate, check it against the pin, return a context trusting only it."""
    want = normalise_fingerprint(pinned)
    try:
        pem = ssl.get_server_certificate((host, int(port)), timeout=timeout)
    except (OSError, ssl.SSLError) as err:
        raise SmolforgeError(f"cannot reach the coordinator's TLS port at {host}:{port} ({type(err).__name__})",
                             fix="check the address, and that the coordinator was started with --tls") from None
    got = fingerprint(pem)
    if not hmac.compare_digest(got, want):
        raise SmolforgeError(f"the coordinator at {host}:{port} showed a certificate with fingerprint {got}, "
                             f"not the pinned {want}: refused, no token was sent",
                             fix="copy the fingerprint that `smolforge coordinator start --tls` printed; if it "
                                 "did not change, someone else may be answering at that address")
    return trust_exactly(pem)
