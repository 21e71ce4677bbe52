"""The security check: the join token and TLS files this process would start with.

Beyond what ``mesh.security.validate`` refuses at start (files unreadable, not PEM,
settings that do not go together), the certificate is read: in its validity period,
its key the one given, signed by the CA given, and naming every address peers dial
(an IP address or a DNS name, ``*.domain`` wildcards included).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from mesh.doctor.results import CheckResult, failed, passed, warned
from mesh.errors import InvalidRequest
from mesh.security import TOKEN_ENV, WEAK_TOKEN_CHARS, MeshSecurity, read_pem, validate

# A certificate that ends sooner than this is a WARN.
EXPIRY_WARNING = datetime.timedelta(days=14)
CERTS_HINT = "mesh-coordinator certs --out DIR --hosts HOST,... creates new ones"


def check_security(
    security: MeshSecurity,
    dialled: Sequence[tuple[str, str]],
    now: datetime.datetime | None = None,
) -> list[CheckResult]:
    """``dialled``: ``(host, where it comes from)`` for each address peers use to reach
    this process (``("10.0.0.5", "--advertise")``)."""
    results = [_token(security)]
    if not security.tls_enabled:
        results.append(
            warned(
                "tls",
                "off: gRPC between nodes is plaintext",
                "give --tls-cert/--tls-key/--tls-ca on every node (" + CERTS_HINT + ")",
            )
        )
        return results
    try:
        validate(security, serving=True, certificate=False)
    except InvalidRequest as error:
        return [*results, failed("tls", error.message, "fix the TLS flags or [security] table")]
    now = now or datetime.datetime.now(datetime.UTC)
    return [*results, _certificate(security, dialled, now)]


def certificate_problem(
    security: MeshSecurity, dialled: Sequence[tuple[str, str]] = ()
) -> str | None:
    """What makes this node's certificate unusable (not the key's, expired, not
    signed by ``tls_ca``, not naming a ``(host, where)`` of ``dialled``: the
    addresses peers dial it at), as one line with what to do; None when it is
    usable."""
    result = _certificate(security, dialled, datetime.datetime.now(datetime.UTC))
    return f"{result.detail}; {result.fix}" if result.status == "FAIL" else None


def _token(security: MeshSecurity) -> CheckResult:
    if security.join_token and len(security.join_token) < WEAK_TOKEN_CHARS:
        return warned(
            "join token",
            f"set, but {len(security.join_token)} characters: a short secret can be guessed",
            f"use a random one of {WEAK_TOKEN_CHARS} or more (`openssl rand -hex 32`)",
        )
    if security.join_token:
        return passed("join token", "set: peers without it are refused")
    return warned(
        "join token",
        "none: any host that reaches the gRPC port can join or send traffic",
        f"set {TOKEN_ENV} or --join-token-file on every node",
    )


def _certificate(
    security: MeshSecurity, dialled: Sequence[tuple[str, str]], now: datetime.datetime
) -> CheckResult:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    assert security.tls_cert is not None and security.tls_key is not None
    cert_path, key_path = Path(security.tls_cert), Path(security.tls_key)
    try:
        cert = x509.load_pem_x509_certificate(read_pem(cert_path))
    except ValueError as error:
        return failed("tls", f"{cert_path} is not a certificate: {error}", CERTS_HINT)
    try:
        key = serialization.load_pem_private_key(read_pem(key_path), password=None)
    except (ValueError, TypeError) as error:
        return failed("tls", f"{key_path} is not an unencrypted private key: {error}", CERTS_HINT)
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.PEM
    if key.public_key().public_bytes(encoding, public) != cert.public_key().public_bytes(
        encoding, public
    ):
        return failed(
            "tls", f"{key_path} is not the key of {cert_path}", "give the key made with it"
        )
    problem = _validity(cert, cert_path, now)
    if problem is not None and problem.status == "FAIL":
        return problem
    if security.tls_ca is not None:
        refused = _issuer(cert, cert_path, Path(security.tls_ca), now)
        if refused is not None:
            return refused
    names = _names(cert)
    missing = [(host, where) for host, where in dialled if not _covers(names, host)]
    if missing:
        shown = ", ".join(f"{host} ({where})" for host, where in missing)
        return failed(
            "tls",
            f"{cert_path} names {', '.join(names) or 'no host'}, not {shown}: a node that "
            "dials it there refuses the connection",
            f"re-create it with those hosts ({CERTS_HINT}) or advertise a name it holds",
        )
    if problem is not None:
        return problem
    until = cert.not_valid_after_utc.date().isoformat()
    return passed("tls", f"{cert_path} names {', '.join(names)}, valid until {until}")


def _validity(cert, path: Path, now: datetime.datetime) -> CheckResult | None:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now > end:
        return failed("tls", f"{path} expired on {end:%Y-%m-%d %H:%M} UTC", CERTS_HINT)
    if now < start:
        return failed(
            "tls",
            f"{path} is not valid before {start:%Y-%m-%d %H:%M} UTC",
            "check this host's clock, or " + CERTS_HINT,
        )
    if end - now < EXPIRY_WARNING:
        days = (end - now).days
        return warned("tls", f"{path} expires in {days} day(s), on {end:%Y-%m-%d}", CERTS_HINT)
    return None


def _issuer(cert, cert_path: Path, ca_path: Path, now: datetime.datetime) -> CheckResult | None:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        ca = x509.load_pem_x509_certificate(read_pem(ca_path))
    except ValueError as error:
        return failed("tls", f"{ca_path} is not a certificate: {error}", CERTS_HINT)
    if now > ca.not_valid_after_utc:
        return failed(
            "tls", f"the CA {ca_path} expired on {ca.not_valid_after_utc:%Y-%m-%d}", CERTS_HINT
        )
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as error:
        reason = str(error) or "its signature does not verify"
        return failed(
            "tls",
            f"{cert_path} is not signed by the CA {ca_path} ({reason})",
            "give the CA that signed it as --tls-ca, or " + CERTS_HINT,
        )
    return None


def _names(cert) -> list[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] + list(
        san.get_values_for_type(x509.DNSName)
    )


def _covers(names: Sequence[str], host: str) -> bool:
    """Whether a certificate naming ``names`` is valid for ``host`` (RFC 6125: one
    wildcard label, leftmost; IP addresses only as IP entries)."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for name in names:
        name = name.lower()
        if address is not None:
            try:
                if ipaddress.ip_address(name) == address:
                    return True
            except ValueError:
                continue
        elif name == host:
            return True
        elif name.startswith("*.") and "." in host and host.split(".", 1)[1] == name[2:]:
            return True
    return False
