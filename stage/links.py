"""Outgoing data links of a stage: Forward to the next stage and Return to stage 0.

A link first asks its peer's ``StageData.Endpoint`` how to reach it: over framed TCP
(``stage/tcp_data.py``: one connection, the message written by the thread that
produced it) when the peer listens for it, else over the ``Forward`` / ``Return``
gRPC streams, where a link owns a channel, a send queue feeding the request stream,
and a thread that watches the stream's end."""

from __future__ import annotations

import logging
import queue
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from mesh.codec import FrameAck, ack_from_proto
from mesh.errors import LoadCancelled, Unavailable
from mesh.grpc_util import channel
from mesh.netaddr import split_host_port
from mesh.proto.v1 import data_pb2, data_pb2_grpc
from mesh.threads import NamedThread
from stage.tcp_data import KIND_FORWARD, KIND_RETURN, TcpLink, sleep_until

if TYPE_CHECKING:
    from stage.metrics import LinkTraffic

logger = logging.getLogger(__name__)

_CLOSE = object()
CONNECT_TIMEOUT_S = 10.0
# How often a Load waiting for a neighbour's answer looks whether it was released.
CANCEL_POLL_S = 0.25


class DataLink(Protocol):
    """What the stage node needs of an outgoing link, whatever carries it."""

    address: str
    name: str

    @property
    def broken(self) -> bool: ...

    def send(self, message: Any) -> None: ...

    def close(self) -> None: ...


def tcp_endpoint(
    address: str,
    cancelled: Callable[[], bool] | None = None,
    timeout_s: float = CONNECT_TIMEOUT_S,
) -> tuple[str, bool]:
    """The peer's framed TCP endpoint and whether it speaks TLS, asked over gRPC at
    ``address``; ("", False) when it has none (or predates the Endpoint call). A peer
    not answering yet (its server starting) is waited for up to ``timeout_s``,
    asked again every CANCEL_POLL_S: ``cancelled()`` true ends the wait at once
    (LoadCancelled), as a Release of the load does."""
    ch = channel(address)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if cancelled is not None and cancelled():
                raise LoadCancelled(
                    f"the load was released while it waited for {address} to answer"
                )
            left = deadline - time.monotonic()
            try:
                reply = data_pb2_grpc.StageDataStub(ch).Endpoint(
                    data_pb2.EndpointRequest(),
                    timeout=max(0.01, min(CANCEL_POLL_S, left)),
                    wait_for_ready=True,
                )
                return reply.tcp, reply.tls
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return "", False
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED or left <= CANCEL_POLL_S:
                    raise Unavailable(
                        f"cannot reach {address} within {timeout_s:.0f}s: {_describe(error)}"
                    ) from error
    finally:
        ch.close()


def peer_serving(address: str, timeout_s: float) -> tuple[int, bool]:
    """The term whose layers the stage at ``address`` serves now (0: none) and
    whether its own Forward link is broken, asked over ``Endpoint``; Unavailable
    when it does not answer within ``timeout_s``."""
    ch = channel(address)
    try:
        reply = data_pb2_grpc.StageDataStub(ch).Endpoint(
            data_pb2.EndpointRequest(), timeout=timeout_s
        )
        return reply.serving_term, reply.forward_broken
    except grpc.RpcError as error:
        raise Unavailable(f"{address} does not answer: {_describe(error)}") from error
    finally:
        ch.close()


def probe_link(address: str, timeout_s: float) -> str:
    """Why this stage could not open a data link to the stage at ``address`` (its
    gRPC address) now, or '' when it could: the peer answers ``Endpoint`` and, when
    it takes framed TCP, its data port accepts a connection (closed at once, before
    any hello). A peer that predates ``Endpoint`` is not judged."""
    try:
        endpoint, _ = tcp_endpoint(address, timeout_s=timeout_s)
    except Unavailable as error:
        return error.message
    if not endpoint:
        return ""
    try:
        host, port = split_host_port(endpoint)
        socket.create_connection((host, port), timeout=timeout_s).close()
    except (OSError, ValueError) as error:
        return f"cannot connect to its data port {endpoint} ({error})"
    return ""


def open_forward_link(
    address: str,
    on_broken: Callable[[Exception], None],
    on_ack: Callable[[FrameAck], None],
    delay_s: float = 0.0,
    traffic: LinkTraffic | None = None,
    cancelled: Callable[[], bool] | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> DataLink:
    """The link to the downstream stage at ``address`` (its gRPC address); the peer
    is waited for up to ``connect_timeout_s``."""
    endpoint, tls = tcp_endpoint(address, cancelled, connect_timeout_s)
    if endpoint:
        return TcpLink(
            endpoint,
            KIND_FORWARD,
            on_broken,
            tls=tls,
            delay_s=delay_s,
            traffic=traffic,
            connect_timeout_s=connect_timeout_s,
        )
    return ForwardLink(address, on_broken, on_ack, delay_s, traffic)


def open_return_link(
    address: str,
    on_broken: Callable[[Exception], None],
    delay_s: float = 0.0,
    traffic: LinkTraffic | None = None,
    cancelled: Callable[[], bool] | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> DataLink:
    """The link to stage 0 at ``address`` (its gRPC address); the peer is waited for
    up to ``connect_timeout_s``."""
    endpoint, tls = tcp_endpoint(address, cancelled, connect_timeout_s)
    if endpoint:
        return TcpLink(
            endpoint,
            KIND_RETURN,
            on_broken,
            tls=tls,
            delay_s=delay_s,
            traffic=traffic,
            connect_timeout_s=connect_timeout_s,
        )
    return ReturnLink(address, on_broken, delay_s, traffic)


class _StreamLink(ABC):
    """Base: a client stream whose requests come from a queue."""

    def __init__(
        self,
        address: str,
        name: str,
        on_broken: Callable[[Exception], None],
        delay_s: float = 0.0,
        traffic: LinkTraffic | None = None,
    ) -> None:
        """``traffic`` counts the messages and bytes that go out (metrics)."""
        self.address = address
        self.delay_s = delay_s
        self.name = name
        self._traffic = traffic
        self._on_broken = on_broken
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: Exception | None = None
        self._closed = False
        self._channel = channel(address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError as error:
            self._channel.close()
            raise Unavailable(
                f"{name} link: cannot reach {address} within {CONNECT_TIMEOUT_S:.0f}s"
            ) from error
        self._stub = data_pb2_grpc.StageDataStub(self._channel)
        self._thread = NamedThread(target=self._run, name=f"{name}-link", daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            due, message = item
            sleep_until(due)
            if self._traffic is not None:
                self._traffic.count(message.ByteSize())
            yield message

    def _run(self) -> None:
        try:
            self._consume()
            if not self._closed:
                raise Unavailable(f"{self.name} link to {self.address} ended")
        except Exception as error:  # noqa: BLE001 - any stream failure breaks the link
            if self._closed:
                return
            self._broken = error
            logger.warning("%s link to %s broke: %s", self.name, self.address, _describe(error))
            self._on_broken(error)

    @abstractmethod
    def _consume(self) -> None:
        """Run the RPC until the stream ends."""

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, message) -> None:
        if self._broken is not None:
            raise Unavailable(
                f"{self.name} link to {self.address} is down: {_describe(self._broken)}"
            )
        self._queue.put((time.monotonic() + self.delay_s, message))

    def close(self) -> None:
        self._closed = True
        self._queue.put(_CLOSE)
        self._channel.close()


class ForwardLink(_StreamLink):
    """Frames to the downstream stage; failure acks come back on the same stream."""

    def __init__(
        self,
        address: str,
        on_broken: Callable[[Exception], None],
        on_ack: Callable[[FrameAck], None],
        delay_s: float = 0.0,
        traffic: LinkTraffic | None = None,
    ) -> None:
        self._on_ack = on_ack
        super().__init__(address, "forward", on_broken, delay_s, traffic)

    def _consume(self) -> None:
        for ack in self._stub.Forward(self._requests()):
            self._on_ack(ack_from_proto(ack))


class ReturnLink(_StreamLink):
    """Token results (and errors) straight to stage 0."""

    def __init__(
        self,
        address: str,
        on_broken: Callable[[Exception], None],
        delay_s: float = 0.0,
        traffic: LinkTraffic | None = None,
    ) -> None:
        super().__init__(address, "return", on_broken, delay_s, traffic)

    def _consume(self) -> None:
        self._stub.Return(self._requests())


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error)
