"""Ray's own TLS for a `--tls` cluster: the coordinator is the certificate authority of its nodes.

Why: `--tls` protects our API, but Ray's traffic between nodes (task arguments, results, the object
store) would still cross the Wi-Fi in clear. Ray 2.60 encrypts every one of its gRPC connections with
mutual TLS when `RAY_USE_TLS=1` names a CA and a certificate and key for the node, and its token auth
keeps working beside it (tested). Ray checks the certificate's names against the address it dials and
requires a client certificate signed by the CA, so one shared certificate would not do across machines
whose addresses change: each node gets its own.

How: the coordinator makes a CA once (`<state>/tls/ray-ca.*`, key 0600, never leaves it) and signs a
certificate for itself and for each worker that joins. A worker makes its key locally, sends a
certificate request over the pinned https API with the cluster token, and gets back a certificate
naming every address of its machine (Ray may pick any of them as the node address) plus the CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Mapping

from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_write_bytes, private_dir

CA_CERT, CA_KEY = "ray-ca.pem", "ray-ca.key"
NODE_CERT, NODE_KEY = "ray-node.pem", "ray-node.key"
MAX_NAMES = 64
VALID_DAYS = 3650


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def ensure_ca(tls_dir: Path) -> tuple[Path, Path]:
    """The cluster's CA under `tls_dir` (made on first use); returns (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir = private_dir(tls_dir)
    cert_path, key_path = tls_dir / CA_CERT, tls_dir / CA_KEY
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smolforge cluster CA (Ray TLS)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    atomic_write_bytes(key_path, _key_pem(key))  # written 0600 (mkstemp), in a 0700 directory
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def machine_addresses() -> list[str]:
    """Every IP address of this machine (Ray may advertise any of them) and loopback."""
    import socket

    import psutil

    found = {"127.0.0.1"}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    found.add(str(ipaddress.ip_address(a.address.split("%")[0])))
                except ValueError:
                    pass
    return sorted(found)[:MAX_NAMES - 1]


def make_request(addresses: list[str]) -> tuple[bytes, str]:
    """A new private key (PEM) and a certificate request for `addresses` (PEM text)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost")] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smolforge node")]))
           .add_extension(x509.SubjectAlternativeName(names), critical=False)
           .sign(key, hashes.SHA256()))
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM).decode()


def sign_request(csr_pem: str, ca_cert: Path, ca_key: Path) -> str:
    """The CA's certificate for a node's request; only its key and its addresses are taken from it.

    The request must be signed by its own key and name at most MAX_NAMES IP addresses (or
    "localhost"); anything else is refused, so a token holder cannot get a CA or a certificate for a
    host name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    bad = SmolforgeError("not a node certificate request", fix="send the request `smolforge worker join` makes")
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
        names = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound):
        raise bad from None
    if not csr.is_signature_valid or len(list(names)) > MAX_NAMES:
        raise bad
    alt: list[x509.GeneralName] = []
    for n in names:
        if isinstance(n, x509.IPAddress) or (isinstance(n, x509.DNSName) and n.value == "localhost"):
            alt.append(n)
        else:
            raise bad
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    key = serialization.load_pem_private_key(ca_key.read_bytes(), None)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca.subject)
            .public_key(csr.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def write_node_files(node_dir: Path, key_pem: bytes, cert_pem: str, ca_pem: str) -> dict[str, str]:
    """Store this node's key (0600), certificate and the CA; returns the environment Ray reads."""
    d = private_dir(Path(node_dir))
    atomic_write_bytes(d / NODE_KEY, key_pem)  # 0600
    atomic_write_bytes(d / NODE_CERT, cert_pem.encode())
    atomic_write_bytes(d / CA_CERT, ca_pem.encode())
    return ray_tls_env(d / NODE_CERT, d / NODE_KEY, d / CA_CERT)


def issue_node_files(tls_dir: Path, node_dir: Path, addresses: list[str]) -> dict[str, str]:
    """The coordinator's own node certificate, signed by its CA directly (no request over the network).

    Kept while it names every current address and comes from this CA: a Ray head that outlived its
    coordinator keeps reading the same files."""
    ca_cert, ca_key = ensure_ca(tls_dir)
    d = Path(node_dir)
    if _still_good(d, ca_cert, addresses):
        return ray_tls_env(d / NODE_CERT, d / NODE_KEY, d / CA_CERT)
    key_pem, csr = make_request(addresses)
    return write_node_files(d, key_pem, sign_request(csr, ca_cert, ca_key), ca_cert.read_text())


def _still_good(node_dir: Path, ca_cert: Path, addresses: list[str]) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate((node_dir / NODE_CERT).read_bytes())
        if not (node_dir / NODE_KEY).is_file() or (node_dir / CA_CERT).read_bytes() != ca_cert.read_bytes():
            return False
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_cert.read_bytes()))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    have = {str(n.value) for n in names}
    return set(addresses) <= have and cert.not_valid_after_utc > datetime.datetime.now(datetime.timezone.utc)


def ray_tls_env(cert: Path, key: Path, ca: Path) -> dict[str, str]:
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(cert), "RAY_TLS_SERVER_KEY": str(key),
            "RAY_TLS_CA_CERT": str(ca)}


def node_files_from_env(env: Mapping[str, str] | None = None, required: bool = False) -> tuple[str, str, str] | None:
    """(certificate, key, CA) of this node when the cluster runs Ray with TLS, else None (an error when
    `required`: the cluster runs with TLS, so this node must too).

    Why: a service a job starts beside Ray (a split job's trunk) must not be the one plaintext
    channel of a `--tls` cluster. Every Ray process of such a node has these in its environment (the
    node was started with them), and the certificate names every address of the machine, signed by
    the cluster's CA: the service serves with it and its clients trust exactly that CA."""
    env = os.environ if env is None else env
    if env.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        if required:
            raise SmolforgeError("the cluster runs with TLS but this node does not run Ray with TLS",
                                 where="RAY_USE_TLS", fix="start the node again with `smolforge worker join`")
        return None
    files = tuple(env.get(k, "") for k in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"))
    if not all(files):
        raise SmolforgeError("this node runs Ray with TLS but its certificate, key or CA is not named",
                             where="RAY_TLS_SERVER_CERT / RAY_TLS_SERVER_KEY / RAY_TLS_CA_CERT",
                             fix="start the node again with `smolforge worker join` (it fetches its certificate)")
    return files  # type: ignore[return-value]


def request_node_env(post, node_dir: Path) -> dict[str, str]:
    """Join a TLS cluster's Ray: a key made here, a certificate from the coordinator, Ray's environment.

    `post(path, json) -> dict` is an authenticated call to the coordinator over its pinned https."""
    key_pem, csr = make_request(machine_addresses())
    answer = post("/api/v1/ray-tls/certificate", {"csr": csr})
    return write_node_files(node_dir, key_pem, answer["certificate"], answer["ca"])
