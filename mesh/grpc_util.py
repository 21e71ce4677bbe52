"""Shared gRPC settings: message limits, channels and servers with the mesh's
security (join token, TLS), and error mapping.

Used by the stage and coordinator servicers and clients (never by compute code).
Every channel and server of the mesh is made here, so the settings installed with
``mesh.security.install`` apply to all of them.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from mesh.errors import MeshError, Unavailable, from_code, grpc_code_name
from mesh.security import (
    JoinTokenClientInterceptor,
    JoinTokenInterceptor,
    MeshSecurity,
    active,
    channel_credentials,
    server_credentials,
)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CONTROL_DEADLINE_S = 10.0
LOAD_DEADLINE_S = 600.0

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def channel(address: str, security: MeshSecurity | None = None) -> grpc.Channel:
    """A channel to ``host:port`` with the mesh's limits: TLS when configured, and the
    join token on every call when one is set. ``security`` defaults to the installed
    settings (``mesh.security.install``)."""
    security = active() if security is None else security
    credentials = channel_credentials(security)
    if credentials is None:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        ch = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    if security.join_token:
        ch = grpc.intercept_channel(ch, JoinTokenClientInterceptor(security.join_token))
    return ch


def new_server(max_workers: int, security: MeshSecurity | None = None) -> grpc.Server:
    """A gRPC server with the mesh's limits that refuses calls without the join token
    when one is set. Bind it with ``bind``."""
    security = active() if security is None else security
    interceptors = [JoinTokenInterceptor(security.join_token)] if security.join_token else []
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
        raise Unavailable(f"cannot listen on {listen}: {error}; is the port in use?") from error
    if port == 0:
        raise Unavailable(f"cannot listen on {listen}; is the port in use?")
    return port


def abort_with(context: grpc.ServicerContext, error: BaseException) -> None:
    """Abort an RPC with the status code that matches the error class."""
    code = getattr(grpc.StatusCode, grpc_code_name(error), grpc.StatusCode.INTERNAL)
    message = error.message if isinstance(error, MeshError) else f"internal error: {error}"
    context.abort(code, message)


def error_from_rpc(error: grpc.RpcError, what: str) -> MeshError:
    """A typed MeshError for a failed call, with ``what`` naming the call and peer."""
    code = error.code() if hasattr(error, "code") else None
    name = code.name if code is not None else "UNAVAILABLE"
    details = error.details() if hasattr(error, "details") else str(error)
    return from_code(name, f"{what}: {details}")
