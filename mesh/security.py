"""Who may talk to the mesh: the join token and TLS settings of every gRPC link.

One ``MeshSecurity`` per process, resolved at start-up from the command line, the
environment and ``[security]`` in mesh.toml, then installed with ``install`` so that
every channel and server the process opens (``mesh.grpc_util``) uses it.

- Join token: every call carries it as metadata; servers check it with a
  constant-time comparison and answer UNAUTHENTICATED without it. It is read from
  ``MESH_JOIN_TOKEN`` or a file (``--join-token-file``), never from a plain flag, so
  it shows in neither ``ps`` nor logs.
- TLS: servers present ``tls_cert``/``tls_key``; clients verify against ``tls_ca``.
  With ``tls_mutual`` servers also require a client certificate signed by the CA,
  and clients present theirs.

This module resolves and checks the settings; ``mesh.grpc_util`` turns them into
credentials and interceptors.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

TOKEN_ENV = "MESH_JOIN_TOKEN"
TOKEN_METADATA_KEY = "mesh-join-token"
REFUSED_MESSAGE = (
    "missing or wrong mesh join token; set MESH_JOIN_TOKEN or --join-token-file on every node"
)
# A join token shorter than this is logged as weak (a random secret of 32 hex digits
# and more is what the docs ask for).
WEAK_TOKEN_CHARS = 16
SECURITY_KEYS = ("join_token_file", "tls_cert", "tls_key", "tls_ca", "tls_mutual")


@dataclass(frozen=True)
class MeshSecurity:
    """The security settings of one process. The default is an open mesh."""

    join_token: str | None = field(default=None, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    tls_mutual: bool = False

    @property
    def tls_enabled(self) -> bool:
        return any((self.tls_cert, self.tls_key, self.tls_ca, self.tls_mutual))

    def describe(self) -> str:
        """One line for the start-up log; never contains the token."""
        token = "join token required" if self.join_token else "no join token"
        if not self.tls_enabled:
            return f"{token}, plaintext gRPC"
        return f"{token}, {'mutual TLS' if self.tls_mutual else 'TLS'} (CA {self.tls_ca or '-'})"

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment of a local stage process this one spawns: the token
        travels in ``MESH_JOIN_TOKEN``, never on the command line."""
        env = dict(base)
        if self.join_token:
            env[TOKEN_ENV] = self.join_token
        return env

    def child_argv(self) -> list[str]:
        """The TLS flags of a local stage process this one spawns (absolute paths)."""
        argv: list[str] = []
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-ca", self.tls_ca),
        ):
            if path is not None:
                argv += [flag, str(Path(path).absolute())]
        if self.tls_mutual:
            argv.append("--tls-mutual")
        return argv


# ---- resolution ----------------------------------------------------------------------


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The join-token and TLS flags, shared by `mesh-coordinator` and `mesh-stage`."""
    group = parser.add_argument_group("security")
    group.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        help=f"file holding the mesh join token (or set {TOKEN_ENV})",
    )
    group.add_argument("--tls-cert", type=Path, default=None, help="this node's certificate (PEM)")
    group.add_argument("--tls-key", type=Path, default=None, help="this node's private key (PEM)")
    group.add_argument("--tls-ca", type=Path, default=None, help="CA that signs the mesh (PEM)")
    group.add_argument(
        "--tls-mutual",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="require client certificates signed by --tls-ca and present this node's",
    )


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as error:
        raise InvalidRequest(
            f"cannot read the join token file {path}: {error.strerror}; "
            "check --join-token-file (or [security] join_token_file in mesh.toml)"
        ) from error
    token = check_token(text.strip(), f"join token file {path}")
    try:
        mode = Path(path).expanduser().stat().st_mode
    except OSError:
        mode = 0
    if mode & 0o077:
        logger.warning(
            "the join token file %s can be read by other users of this host (mode %o); "
            "chmod 600 it",
            path,
            mode & 0o777,
        )
    return token


def check_token(token: str, where: str) -> str:
    """Reject tokens that cannot travel as gRPC metadata."""
    if not token:
        raise InvalidRequest(f"{where} is empty; write a random secret into it")
    if not (token.isascii() and token.isprintable()):
        raise InvalidRequest(
            f"{where} holds characters that cannot be sent as gRPC metadata; "
            "use printable ASCII (e.g. the output of `openssl rand -hex 32`)"
        )
    return token


def _toml_security(toml: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    table = toml.get("security", {})
    if not isinstance(table, dict):
        raise InvalidRequest("config: [security] must be a table")
    unknown = sorted(set(table) - set(SECURITY_KEYS))
    if unknown:
        raise InvalidRequest(
            f"config: unknown key(s) {', '.join(unknown)} in [security]; "
            f"known keys: {', '.join(SECURITY_KEYS)} (the token itself belongs in a file)"
        )
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "tls_mutual":
            if not isinstance(value, bool):
                raise InvalidRequest("config: [security] tls_mutual must be true or false")
            values[key] = value
        else:
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"config: [security] {key} must be a file path")
            path = Path(value).expanduser()
            values[key] = path if path.is_absolute() else base_dir / path
    return values


def _config_security(args: argparse.Namespace) -> dict[str, Any]:
    """``[security]`` of the ``--config`` TOML (relative paths made absolute)."""
    config = getattr(args, "config", None)
    if not config:
        return {}
    from mesh.config import check_toml, load_toml

    whole = load_toml(config)
    # The whole file is checked here, when up and join start: a typo in any
    # table fails now, not when stage 0 loads.
    check_toml(whole)
    return _toml_security(whole, Path(config).expanduser().absolute().parent)


def security_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[tuple[str, Any, str]]:
    """``(key, value, origin)`` of every security setting, for ``--print-config``: as
    ``security_from_args`` resolves them, the token shown only as where it comes from."""
    environ = os.environ if environ is None else environ
    toml = _config_security(args)
    config = f"config file {getattr(args, 'config', '')}"
    out: list[tuple[str, Any, str]] = []
    token_file = getattr(args, "join_token_file", None)
    if token_file is not None:
        out.append(("security.join_token", f"read from {token_file}", "--join-token-file"))
    elif environ.get(TOKEN_ENV):
        out.append(("security.join_token", "set", f"environment {TOKEN_ENV}"))
    elif toml.get("join_token_file") is not None:
        out.append(("security.join_token", f"read from {toml['join_token_file']}", config))
    else:
        out.append(("security.join_token", None, "built-in default: no token"))
    for key in ("tls_cert", "tls_key", "tls_ca", "tls_mutual"):
        flag = getattr(args, key, None)
        if flag is not None:
            value, origin = flag, "--" + key.replace("_", "-")
        elif key in toml:
            value, origin = toml[key], config
        else:
            value, origin = (False if key == "tls_mutual" else None), "built-in default"
        out.append(
            (f"security.{key}", value if isinstance(value, bool | None) else str(value), origin)
        )
    return out


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> MeshSecurity:
    """Resolve the settings: flags > environment (``MESH_JOIN_TOKEN``) > ``[security]``
    in the ``--config`` TOML (relative paths there are relative to that file)."""
    environ = os.environ if environ is None else environ
    toml = _config_security(args)

    def pick(key: str) -> Any:
        value = getattr(args, key, None)
        return toml.get(key) if value is None else value

    token_file = getattr(args, "join_token_file", None)
    if token_file is not None:
        token: str | None = read_token_file(token_file)
    elif environ.get(TOKEN_ENV):
        token = check_token(environ[TOKEN_ENV].strip(), TOKEN_ENV)
    elif toml.get("join_token_file") is not None:
        token = read_token_file(toml["join_token_file"])
    else:
        token = None
    return MeshSecurity(
        join_token=token,
        tls_cert=pick("tls_cert"),
        tls_key=pick("tls_key"),
        tls_ca=pick("tls_ca"),
        tls_mutual=bool(pick("tls_mutual")),
    )


def validate(security: MeshSecurity, serving: bool, certificate: bool = True) -> MeshSecurity:
    """Check that the TLS settings fit together and that every file is a readable PEM
    file; ``serving`` is True for a process that runs a gRPC server, whose
    certificate (with ``certificate``) must also be valid now, match its key and be
    signed by ``tls_ca`` (else gRPC fails at bind time with a message about the
    port, or peers refuse it)."""
    if (security.tls_cert is None) != (security.tls_key is None):
        raise InvalidRequest("--tls-cert and --tls-key go together: give both or neither")
    if security.tls_mutual and security.tls_ca is None:
        raise InvalidRequest("mutual TLS needs --tls-ca: the CA that signs every node")
    if security.tls_mutual and security.tls_cert is None:
        raise InvalidRequest(
            "mutual TLS needs --tls-cert and --tls-key: every node presents a certificate"
        )
    if serving and security.tls_enabled and security.tls_cert is None:
        raise InvalidRequest(
            "this node serves gRPC and TLS is on (--tls-ca or --tls-mutual given): it needs "
            "--tls-cert and --tls-key too (mesh-coordinator certs creates them)"
        )
    for path in (security.tls_cert, security.tls_key, security.tls_ca):
        if path is not None:
            read_pem(path)
    if serving and certificate and security.tls_cert is not None:
        from mesh.doctor.tls import certificate_problem

        problem = certificate_problem(security)
        if problem is not None:
            raise InvalidRequest(problem)
    return security


def read_pem(path: Path) -> bytes:
    """The bytes of a PEM file; InvalidRequest when unreadable or not PEM."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as error:
        raise InvalidRequest(f"cannot read TLS file {path}: {error.strerror}") from error
    if b"-----BEGIN " not in data:
        raise InvalidRequest(f"TLS file {path} is not PEM (no -----BEGIN line)")
    return data


# ---- the process-wide setting --------------------------------------------------------

_active = MeshSecurity()
_active_lock = threading.Lock()
_posture_logged = False


def install(security: MeshSecurity) -> None:
    """Make ``security`` the default of every channel and server of this process."""
    global _active
    with _active_lock:
        _active = security


def active() -> MeshSecurity:
    """The installed settings (an open mesh until ``install`` is called)."""
    return _active


def log_posture(security: MeshSecurity, role: str) -> None:
    """Log once per process how this node is protected; warn when it is open."""
    global _posture_logged
    with _active_lock:
        if _posture_logged:
            return
        _posture_logged = True
    if not security.join_token:
        logger.warning(
            "the mesh is unauthenticated: %s runs without a join token, so any host that "
            "can reach its gRPC port can join or send traffic; set %s or --join-token-file "
            "on every node",
            role,
            TOKEN_ENV,
        )
    elif not security.tls_enabled:
        logger.warning(
            "%s requires the join token but gRPC is plaintext: the token and activations "
            "cross the network unencrypted; add --tls-cert/--tls-key/--tls-ca",
            role,
        )
    if security.join_token and len(security.join_token) < WEAK_TOKEN_CHARS:
        logger.warning(
            "the join token has %d characters: a short secret can be guessed; use a random "
            "one of %d or more (`openssl rand -hex 32`)",
            len(security.join_token),
            WEAK_TOKEN_CHARS,
        )
    logger.info("%s security: %s", role, security.describe())


_UNRESOLVED = "the name does not resolve: give an address or a resolvable name"
# How the network says a peer is not there (in gRPC's error details): no TLS
# setting changes these.
_NETWORK_FAILURES = (
    ("no route to host", "no route to that host from here: check the address and routing"),
    ("network is unreachable", "that network is unreachable from here: check routing"),
    ("connection refused", "nothing listens there: is it running, on that port?"),
    ("dns resolution failed", _UNRESOLVED),
    ("name or service not known", _UNRESOLVED),
)


def unavailable_hint(security: MeshSecurity, details: str = "") -> str:
    """What to check when a peer cannot be reached (``details``: the error's text):
    what the network said where it said something, else TLS mismatches, which look
    like an unreachable peer."""
    lowered = details.lower()
    for failure, hint in _NETWORK_FAILURES:
        if failure in lowered:
            return hint
    if not security.tls_enabled:
        return (
            "is it running, and does the mesh use TLS? then give --tls-ca "
            "(and --tls-cert/--tls-key)"
        )
    return (
        "is it running with TLS, does its certificate name the address dialled "
        "(--advertise), is it signed by --tls-ca, and does mutual TLS need --tls-cert/--tls-key?"
    )
