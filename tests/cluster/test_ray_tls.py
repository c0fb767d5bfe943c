"""The cluster's CA for Ray's own TLS signs what a node asks for and nothing more."""

from __future__ import annotations

import ipaddress

import pytest

from smolforge.cluster.nodes import ray_tls
from smolforge.errors import SmolforgeError


def _names(pem: str) -> list[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem.encode())
    return [str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]


def test_a_node_request_is_signed_for_its_addresses_only(tmp_path):
    from cryptography import x509

    ca_cert, ca_key = ray_tls.ensure_ca(tmp_path / "tls")
    assert ca_key.stat().st_mode & 0o777 == 0o600
    assert ray_tls.ensure_ca(tmp_path / "tls") == (ca_cert, ca_key)  # made once
    addresses = ray_tls.machine_addresses()
    assert "127.0.0.1" in addresses and all(ipaddress.ip_address(a) for a in addresses)
    key_pem, csr = ray_tls.make_request(addresses)
    pem = ray_tls.sign_request(csr, ca_cert, ca_key)
    assert sorted(_names(pem)) == sorted(["localhost", *addresses])
    cert = x509.load_pem_x509_certificate(pem.encode())
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    env = ray_tls.write_node_files(tmp_path / "node", key_pem, pem, ca_cert.read_text())
    assert env["RAY_USE_TLS"] == "1"
    assert (tmp_path / "node" / ray_tls.NODE_KEY).stat().st_mode & 0o777 == 0o600


def test_a_request_for_a_host_name_or_garbage_is_refused(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert, ca_key = ray_tls.ensure_ca(tmp_path / "tls")
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName("bank.example")]), critical=False)
           .sign(key, hashes.SHA256())).public_bytes(serialization.Encoding.PEM).decode()
    for bad in (csr, "not a request", ray_tls.make_request(["127.0.0.1"])[1].replace("MII", "MIJ", 1)):
        with pytest.raises(SmolforgeError, match="not a node certificate request"):
            ray_tls.sign_request(bad, ca_cert, ca_key)


def test_the_coordinators_own_certificate_is_kept_until_its_addresses_change(tmp_path):
    first = ray_tls.issue_node_files(tmp_path / "tls", tmp_path / "node", ["127.0.0.1"])
    pem = (tmp_path / "node" / ray_tls.NODE_CERT).read_text()
    assert ray_tls.issue_node_files(tmp_path / "tls", tmp_path / "node", ["127.0.0.1"]) == first
    assert (tmp_path / "node" / ray_tls.NODE_CERT).read_text() == pem  # a running Ray head keeps its files
    ray_tls.issue_node_files(tmp_path / "tls", tmp_path / "node", ["127.0.0.1", "192.0.2.77"])
    assert "192.0.2.77" in _names((tmp_path / "node" / ray_tls.NODE_CERT).read_text())  # a new Wi-Fi address
