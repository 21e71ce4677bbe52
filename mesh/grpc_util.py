"""Shared gRPC settings: message limits, channel options, and error mapping.

Used by the stage and coordinator servicers and clients (never by compute code).
"""

from __future__ import annotations

import grpc

from mesh.errors import MeshError, from_code, grpc_code_name

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


def channel(address: str) -> grpc.Channel:
    """An insecure channel to ``host:port`` with the mesh's limits."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


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
