"""`mesh-coordinator certs`: a private CA and node certificates for a small cluster.

Every node is both a gRPC server and a client of the others, so each certificate is
good for server and client authentication. Host names become DNS names in the
subject alternative names, IP addresses become IP entries, and ``*.domain`` is a
wildcard (handy for a Kubernetes StatefulSet behind a headless Service).

Files written under ``--out``:

- ``ca.pem`` (give to every node: ``--tls-ca``) and ``ca-key.pem`` (keep it safe; it
  signs more node certificates later: re-run with the same ``--out``),
- ``node-<host>.pem`` / ``node-<host>-key.pem`` per host, or with ``--shared`` one
  ``node.pem`` / ``node-key.pem`` valid for every host.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
DEFAULT_DAYS = 825
_HOST_RE = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9][A-Za-z0-9-]{0,62})*$")


@dataclass(frozen=True)
class NodeCertificate:
    hosts: tuple[str, ...]
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterCertificates:
    ca_cert: Path
    ca_key: Path
    ca_created: bool
    nodes: tuple[NodeCertificate, ...]


def parse_hosts(text: str) -> tuple[str, ...]:
    """``"head,10.0.0.5, worker-1"`` -> its hosts; each must be a host name, a
    ``*.domain`` wildcard or an IP address."""
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise InvalidRequest("--hosts needs at least one host name or IP address")
    for host in hosts:
        if _is_ip(host):
            continue
        if not _HOST_RE.match(host) or len(host) > 253:
            raise InvalidRequest(
                f"--hosts: {host!r} is neither a host name, a *.domain wildcard nor an IP address"
            )
    if len(set(hosts)) != len(hosts):
        raise InvalidRequest(f"--hosts lists a host twice: {', '.join(hosts)}")
    return hosts


def file_stem(host: str) -> str:
    """A file-name-safe form of a host (``*.x`` -> ``wildcard.x``, ``::1`` -> ``__1``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", host.replace("*", "wildcard", 1))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def generate_cluster_certs(
    out: Path, hosts: tuple[str, ...], *, days: int = DEFAULT_DAYS, shared: bool = False
) -> ClusterCertificates:
    """Create (or reuse) the CA in ``out`` and sign certificates for ``hosts``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if days < 1:
        raise InvalidRequest("--days must be at least 1")
    out = Path(out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidRequest(
            f"--out {out}: cannot make the directory ({error.strerror}); give a directory "
            "path (it is created if missing)"
        ) from None
    ca_cert_path, ca_key_path = out / CA_CERT, out / CA_KEY
    if ca_cert_path.exists() and ca_key_path.exists():
        try:
            ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
            ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        except (ValueError, TypeError) as error:
            raise InvalidRequest(
                f"the CA in {out} cannot be read ({error}); restore {CA_CERT} and {CA_KEY} "
                "or use an empty --out directory"
            ) from None
        if _public(ca_key) != _public(ca_cert):
            raise InvalidRequest(
                f"{ca_key_path} is not the key of {ca_cert_path}: certificates it signed would "
                "not verify against the CA; restore the CA's own key"
            )
        created = False
        logger.info("signing with the existing CA in %s", ca_cert_path)
    elif ca_cert_path.exists() or ca_key_path.exists():
        raise InvalidRequest(
            f"{out} holds only one of {CA_CERT} and {CA_KEY}; restore the other one or "
            "use an empty --out directory"
        )
    else:
        ca_key = _new_key()
        ca_cert = _ca_certificate(ca_key, days)
        _write(ca_key_path, _key_pem(ca_key), private=True)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
        created = True
    groups = [hosts] if shared else [(host,) for host in hosts]
    nodes = []
    for group in groups:
        stem = "node" if shared else f"node-{file_stem(group[0])}"
        key = _new_key()
        cert = _node_certificate(key, group, ca_cert, ca_key, days)
        key_path, cert_path = out / f"{stem}-key.pem", out / f"{stem}.pem"
        _write(key_path, _key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
        nodes.append(NodeCertificate(hosts=group, cert=cert_path, key=key_path))
    return ClusterCertificates(ca_cert_path, ca_key_path, created, tuple(nodes))


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def _ca_certificate(key, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mesh cluster CA")])
    not_before, not_after = _validity(days)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _node_certificate(key, hosts: tuple[str, ...], ca_cert, ca_key, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    names = [
        x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts
    ]
    not_before, not_after = _validity(days)
    not_after = min(not_after, ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


# ---- command line ----------------------------------------------------------------------


def add_certs_parser(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="create a CA and node certificates for TLS")
    certs.add_argument("--out", type=Path, required=True, help="directory for the PEM files")
    certs.add_argument(
        "--hosts",
        required=True,
        help="comma-separated host names / IPs the nodes are reached at, e.g. head,10.0.0.5",
    )
    certs.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    certs.add_argument(
        "--shared", action="store_true", help="one node certificate valid for every host"
    )


def run_certs(args: argparse.Namespace) -> str:
    """Create the files; returns the summary the command prints."""
    made = generate_cluster_certs(
        args.out, parse_hosts(args.hosts), days=args.days, shared=args.shared
    )
    lines = [
        f"CA: {made.ca_cert} ({'created' if made.ca_created else 'existing'}); "
        f"its key {made.ca_key} signs further certificates: keep it off the nodes",
    ]
    for node in made.nodes:
        lines.append(f"{', '.join(node.hosts)}: --tls-cert {node.cert} --tls-key {node.key}")
    lines.append(f"every node: --tls-ca {made.ca_cert} (add --tls-mutual to require client certs)")
    return "\n".join(lines)


def _public(holder: Any) -> bytes:
    """The public key of a private key or a certificate, as PEM bytes."""
    from cryptography.hazmat.primitives import serialization

    key = holder.public_key()
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
