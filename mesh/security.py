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
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

TOKEN_ENV = "MESH_JOIN_TOKEN"
TOKEN_METADATA_KEY = "mesh-join-token"
REFUSED_MESSAGE = (
    "missing or wrong mesh join token; set MESH_JOIN_TOKEN or --join-token-file on every node"
)
SECURITY_KEYS = ("join_token_file", "tls_cert", "tls_key", "tls_ca", "tls_mutual")
REFUSAL_LOG_INTERVAL_S = 30.0


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
    return check_token(text.strip(), f"join token file {path}")


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


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> MeshSecurity:
    """Resolve the settings: flags > environment (``MESH_JOIN_TOKEN``) > ``[security]``
    in the ``--config`` TOML (relative paths there are relative to that file)."""
    environ = os.environ if environ is None else environ
    toml: dict[str, Any] = {}
    config = getattr(args, "config", None)
    if config:
        from mesh.config import load_toml

        toml = _toml_security(load_toml(config), Path(config).expanduser().absolute().parent)

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


def validate(security: MeshSecurity, serving: bool) -> MeshSecurity:
    """Check that the TLS settings fit together and that every file is a readable PEM
    file; ``serving`` is True for a process that runs a gRPC server."""
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
            _read_pem(path)
    return security


def _read_pem(path: Path) -> bytes:
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
    logger.info("%s security: %s", role, security.describe())


# ---- credentials ---------------------------------------------------------------------


def server_credentials(security: MeshSecurity) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None for plaintext."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    pair = [(_read_pem(security.tls_key), _read_pem(security.tls_cert))]
    if security.tls_mutual:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read_pem(security.tls_ca), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(security: MeshSecurity) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client, or None for plaintext. A node with a certificate
    presents it (a server that does not ask for it ignores it)."""
    if not security.tls_enabled:
        return None
    ca = _read_pem(security.tls_ca) if security.tls_ca is not None else None
    if security.tls_cert is not None and security.tls_key is not None:
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=_read_pem(security.tls_key),
            certificate_chain=_read_pem(security.tls_cert),
        )
    return grpc.ssl_channel_credentials(root_certificates=ca)


# ---- the join token on the wire ------------------------------------------------------


class JoinTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``mesh-join-token`` metadata is missing or wrong."""

    def __init__(self, token: str) -> None:
        self._expected = check_token(token, "the join token").encode()
        self._lock = threading.Lock()
        self._last_log = float("-inf")
        self._suppressed = 0

    def authorized(self, metadata: Any) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        return hmac.compare_digest(presented, self._expected)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing_handler(handler, handler_call_details.method, self._note)

    def _note(self, method: str, peer: str) -> None:
        """Log refusals, at most one line per interval (a scanner must not flood logs)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_log < REFUSAL_LOG_INTERVAL_S:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_log = self._suppressed, 0, now
        logger.warning(
            "refused %s from %s: missing or wrong join token (%s more refusals not logged)",
            method,
            peer,
            suppressed,
        )


def _refusing_handler(
    handler: grpc.RpcMethodHandler, method: str, note: Callable[[str, str], None]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        note(method, context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED_MESSAGE)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class _CallDetails(
    namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """Call details with the token added to the metadata."""


class JoinTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the join token to the metadata of every call on a channel."""

    def __init__(self, token: str) -> None:
        self._token = check_token(token, "the join token")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), (TOKEN_METADATA_KEY, self._token)]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
