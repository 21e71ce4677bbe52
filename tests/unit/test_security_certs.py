"""`mesh-coordinator certs`: the CA and node certificates it writes."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from coordinator.certs import file_stem, generate_cluster_certs, parse_hosts
from coordinator.cli import main
from mesh.errors import InvalidRequest


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def names(cert: x509.Certificate) -> set[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)
    }


def test_ca_signs_one_certificate_per_host(tmp_path: Path) -> None:
    made = generate_cluster_certs(tmp_path, ("head", "10.0.0.5", "*.stages.mesh.local"), days=30)
    ca = load(made.ca_cert)
    assert made.ca_created
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert [n.cert.name for n in made.nodes] == [
        "node-head.pem",
        "node-10.0.0.5.pem",
        "node-wildcard.stages.mesh.local.pem",
    ]
    expected_names = ({"head"}, {"10.0.0.5"}, {"*.stages.mesh.local"})
    for node, expected in zip(made.nodes, expected_names, strict=True):
        cert = load(node.cert)
        cert.verify_directly_issued_by(ca)
        assert names(cert) == expected
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert 29 < lifetime.days <= 30
        assert stat.S_IMODE(node.key.stat().st_mode) == 0o600
    san = load(made.nodes[1].cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    assert stat.S_IMODE(made.ca_key.stat().st_mode) == 0o600


def test_existing_ca_is_reused_and_shared_cert_covers_every_host(tmp_path: Path) -> None:
    first = generate_cluster_certs(tmp_path, ("head",))
    ca_bytes = first.ca_cert.read_bytes()
    again = generate_cluster_certs(tmp_path, ("worker-1", "127.0.0.1"), shared=True)
    assert not again.ca_created and again.ca_cert.read_bytes() == ca_bytes
    assert len(again.nodes) == 1 and again.nodes[0].cert.name == "node.pem"
    shared = load(again.nodes[0].cert)
    shared.verify_directly_issued_by(load(first.ca_cert))
    assert names(shared) == {"worker-1", "127.0.0.1"}
    (tmp_path / "ca-key.pem").unlink()
    with pytest.raises(InvalidRequest, match="only one of ca.pem and ca-key.pem"):
        generate_cluster_certs(tmp_path, ("head",))


def test_host_list_is_checked() -> None:
    assert parse_hosts(" head , 127.0.0.1,::1 ") == ("head", "127.0.0.1", "::1")
    for bad in ("", "head,head", "bad host", "-x.example", "a..b"):
        with pytest.raises(InvalidRequest, match="--hosts"):
            parse_hosts(bad)
    assert file_stem("::1") == "__1"


def test_certs_command_prints_the_flags_to_use(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pki"
    assert main(["certs", "--out", str(out), "--hosts", "head,127.0.0.1"]) == 0
    printed = capsys.readouterr().out
    assert f"--tls-cert {out / 'node-head.pem'} --tls-key {out / 'node-head-key.pem'}" in printed
    assert f"--tls-ca {out / 'ca.pem'}" in printed
    assert main(["certs", "--out", str(out), "--hosts", "bad host"]) == 2
    assert "--hosts" in capsys.readouterr().err
