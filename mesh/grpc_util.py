"""Shared gRPC settings: message limits, channels and servers with the mesh's
security (join token, TLS), and error mapping.

Used by the stage and coordinator servicers and clients (never by compute code).
Every channel and server of the mesh is made here, so the settings installed with
``mesh.security.install`` apply to all of them: TLS credentials, and the join token
added to every outgoing call and checked (constant-time) on every incoming one.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import namedtuple
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from mesh.errors import (
    LinkUnreachable,
    MeshError,
    StaleTerm,
    Unavailable,
    from_code,
    grpc_code_name,
)
from mesh.security import (
    REFUSED_MESSAGE,
    TOKEN_METADATA_KEY,
    MeshSecurity,
    active,
    check_token,
    read_pem,
)

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 30.0

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CONTROL_DEADLINE_S = 10.0
# Trailing metadata of a FAILED_PRECONDITION refusal: the term the refusing node holds.
HELD_TERM_KEY = "mesh-held-term"
# The data link a stage could not open (LinkUnreachable: forward or return).
UNREACHABLE_LINK_KEY = "mesh-unreachable-link"
LOAD_DEADLINE_S = 600.0

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # Reconnecting after an outage: gRPC's own backoff grows to 120 s and each attempt
    # may take 20 s, so a stage whose coordinator was cut off for a minute or two
    # stayed away for up to 35 s after the network healed. The first retry after 1 s,
    # then at most every 5 s, each attempt given 5 s (as Join and Heartbeat retry:
    # stage/membership.py).
    ("grpc.initial_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 5_000),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]
# Bulk transfers (package files) get a TCP connection of their own: on a slow link
# the control calls sharing one with them (heartbeats, Claim) waited behind megabytes
# of queued file data, missed their deadlines, and the node was declared dead. Its
# keepalive allows as long as a read may stall (a ping's answer queues behind the
# data too).
BULK_CHANNEL_OPTIONS = [
    *(o for o in CHANNEL_OPTIONS if not o[0].startswith("grpc.keepalive_")),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 60_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS = [
    # gRPC binds with SO_REUSEPORT by default: a second coordinator or stage on a port
    # already served would share it (the kernel splitting connections between them)
    # instead of failing to start.
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def channel(
    address: str, security: MeshSecurity | None = None, *, bulk: bool = False
) -> grpc.Channel:
    """A channel to ``host:port`` with the mesh's limits: TLS when configured, and the
    join token on every call when one is set. ``security`` defaults to the installed
    settings (``mesh.security.install``). ``bulk``: for large transfers, on a TCP
    connection of its own (``BULK_CHANNEL_OPTIONS``)."""
    security = active() if security is None else security
    credentials = channel_credentials(security)
    options = BULK_CHANNEL_OPTIONS if bulk else CHANNEL_OPTIONS
    if credentials is None:
        ch = grpc.insecure_channel(address, options=options)
    else:
        ch = grpc.secure_channel(address, credentials, options=options)
    if security.join_token:
        ch = grpc.intercept_channel(ch, JoinTokenClientInterceptor(security.join_token))
    return ch


def new_server(max_workers: int, security: MeshSecurity | None = None) -> grpc.Server:
    """A gRPC server with the mesh's limits that refuses calls without the join token
    when one is set. Bind it with ``bind``."""
    security = active() if security is None else security
    interceptors: list[grpc.ServerInterceptor] = [RequestDecodingInterceptor()]
    if security.join_token:
        # The token is checked first: a caller without it learns nothing of the
        # methods' messages.
        interceptors.insert(0, JoinTokenInterceptor(security.join_token))
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        interceptors=interceptors,
    )


def bind(srv: grpc.Server, listen: str, security: MeshSecurity | None = None) -> int:
    """Listen on ``host:port`` (TLS when a certificate is configured); the bound port."""
    security = active() if security is None else security
    credentials = server_credentials(security)
    try:
        if credentials is None:
            port = srv.add_insecure_port(listen)
        else:
            port = srv.add_secure_port(listen, credentials)
    except RuntimeError as error:
        # gRPC's own message says only that binding failed.
        raise Unavailable(f"cannot listen on {listen}: {bind_problem(listen)}") from error
    if port == 0:
        raise Unavailable(f"cannot listen on {listen}: {bind_problem(listen)}")
    return port


def bind_problem(listen: str) -> str:
    """Why ``listen`` cannot be bound, found with a plain socket (gRPC says only that
    it failed): the host does not resolve, is not this host's, or the port is taken."""
    import errno
    import socket

    from mesh.netaddr import split_host_port

    try:
        host, port = split_host_port(listen)
    except ValueError as error:
        return f"{error}; write HOST:PORT"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return f"the host {host!r} does not resolve; listen on an address of this host or 0.0.0.0"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} is in use by another process (mesh-coordinator doctor "
                        "or mesh-stage doctor names it); pick another port"
                    )
                if error.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this host; listen on one, or 0.0.0.0"
                return f"{error.strerror}"
    return "is the port in use?"


def abort_with(context: grpc.ServicerContext, error: BaseException) -> None:
    """Abort an RPC with the status code that matches the error class."""
    code = getattr(grpc.StatusCode, grpc_code_name(error), grpc.StatusCode.INTERNAL)
    message = error.message if isinstance(error, MeshError) else f"internal error: {error}"
    if isinstance(error, StaleTerm) and error.held_term:
        context.set_trailing_metadata(((HELD_TERM_KEY, str(error.held_term)),))
    if isinstance(error, LinkUnreachable):
        context.set_trailing_metadata(((UNREACHABLE_LINK_KEY, error.link),))
    context.abort(code, message)


def rpc_status_name(error: grpc.RpcError) -> str:
    """The status name of a failed call. A server-side request stream that ends
    because its caller went away raises a bare RpcError with no status: CANCELLED."""
    code = getattr(error, "code", None)
    return code().name if callable(code) else "CANCELLED"


def error_from_rpc(error: grpc.RpcError, what: str) -> MeshError:
    """A typed MeshError for a failed call, with ``what`` naming the call and peer."""
    code = error.code() if hasattr(error, "code") else None
    name = code.name if code is not None else "UNAVAILABLE"
    details = error.details() if hasattr(error, "details") else str(error)
    typed = from_code(name, f"{what}: {details}")
    if not hasattr(error, "trailing_metadata"):
        return typed
    for key, value in error.trailing_metadata() or ():
        if isinstance(typed, StaleTerm) and key == HELD_TERM_KEY and value.isdigit():
            typed.held_term = int(value)
        if isinstance(typed, Unavailable) and key == UNREACHABLE_LINK_KEY:
            typed = LinkUnreachable(typed.message, value)
    return typed


# ---- credentials ---------------------------------------------------------------------


def server_credentials(security: MeshSecurity) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None for plaintext."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    pair = [(read_pem(security.tls_key), read_pem(security.tls_cert))]
    if security.tls_mutual:
        return grpc.ssl_server_credentials(
            pair, root_certificates=read_pem(security.tls_ca), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(security: MeshSecurity) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client, or None for plaintext. A node with a certificate
    presents it (a server that does not ask for it ignores it)."""
    if not security.tls_enabled:
        return None
    ca = read_pem(security.tls_ca) if security.tls_ca is not None else None
    if security.tls_cert is not None and security.tls_key is not None:
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=read_pem(security.tls_key),
            certificate_chain=read_pem(security.tls_cert),
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


# ---- requests that do not parse ---------------------------------------------------


class _Undecodable:
    """What a guarded deserializer returns for bytes that are not the method's message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RequestDecodingInterceptor(grpc.ServerInterceptor):
    """Answers a request whose bytes do not parse as its method's protobuf message
    with INVALID_ARGUMENT, naming the method and the message expected (grpcio itself
    answers INTERNAL "Exception deserializing request!", which reads as a server
    fault). Streamed requests are checked one by one: a bad one ends its call."""

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _decoding_guarded(handler, handler_call_details.method)


def _decoding_guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that aborts
    with INVALID_ARGUMENT where a request did not parse."""
    deserialize = handler.request_deserializer
    owner = getattr(deserialize, "__self__", None)
    expected = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "its request message")

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - protobuf raises DecodeError and others
            return _Undecodable(str(error) or type(error).__name__)

    def refuse(context: grpc.ServicerContext, request: _Undecodable) -> None:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a valid {expected} ({request.reason}); send "
            "the message proto/ defines for this method, serialized by a protobuf "
            "library, from a client of the same protocol version",
        )

    def checked(requests: Any, context: grpc.ServicerContext) -> Any:
        for request in requests:
            if isinstance(request, _Undecodable):
                refuse(context, request)
            yield request

    streaming = bool(handler.request_streaming), bool(handler.response_streaming)
    if not streaming[0]:
        behaviour = handler.unary_stream if streaming[1] else handler.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                refuse(context, request)
            return behaviour(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if streaming[1]
            else (grpc.unary_unary_rpc_method_handler)
        )
        return make(
            unary, request_deserializer=parse, response_serializer=handler.response_serializer
        )
    behaviour = handler.stream_stream if streaming[1] else handler.stream_unary

    def stream(requests: Any, context: grpc.ServicerContext) -> Any:
        return behaviour(checked(requests, context), context)

    make = (
        grpc.stream_stream_rpc_method_handler
        if streaming[1]
        else (grpc.stream_unary_rpc_method_handler)
    )
    return make(stream, request_deserializer=parse, response_serializer=handler.response_serializer)


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
