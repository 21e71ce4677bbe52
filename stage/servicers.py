"""gRPC servicers of a stage: decode, call the node, encode, map errors."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from mesh.codec import (
    ClaimReply,
    ClaimRequest,
    ErrorInfo,
    FrameAck,
    FrameResult,
    InventoryRequest,
    PrepareReply,
    PrepareRequest,
    ProbeLinkReply,
    ProbeLinkRequest,
    ReleaseReply,
    ReleaseRequest,
    StageLoadRequest,
    ack_to_proto,
    frame_from_proto,
    refused_segment,
    result_from_proto,
    result_to_proto,
    validate_frame,
)
from mesh.errors import InvalidRequest, MeshError, Unavailable
from mesh.grpc_util import abort_with, rpc_status_name
from mesh.proto.v1 import data_pb2, data_pb2_grpc, stage_pb2, stage_pb2_grpc
from mesh.threads import NamedThread
from stage.links import probe_link
from stage.node import LoadedStage, StageNode
from stage.tcp_data import KIND_FORWARD, EndLink, TcpDataServer

logger = logging.getLogger(__name__)

_END = object()
# Streams of each kind a stage takes at once: one upstream stage sends Forward
# frames; every later stage keeps a Return stream to stage 0 (results from the last,
# refusals from any). The rest is room for links being reopened: a dead peer's
# stream may linger until keepalive notices (~15 s) across reloads. Each open
# stream holds one of the gRPC server's threads (STAGE_GRPC_WORKERS), so together
# they leave threads for the control calls. The pool starts its threads as calls
# need them: a mesh of a few stages starts a few. Return streams allow about 100
# stages, as many as framed TCP's link cap.
MAX_STREAMS = {"Forward": 8, "Return": 120}
# How long a ProbeLink waits for the peer's gRPC port, then for its data port.
PROBE_TIMEOUT_S = 3.0
STAGE_GRPC_WORKERS = 160
# What a framed TCP message may hold beyond the frame limit (the validation answers
# an oversized frame with a clear refusal; a link past this is closed).
MESSAGE_SLACK_BYTES = 1 << 20
STAGE0_FORWARD_REFUSAL = (
    "this node is stage 0 (it hosts the HTTP frontend) and takes no Forward frames; "
    "a stage sends them to the stage after it"
)


class ControlServicer(stage_pb2_grpc.StageControlServicer):
    def __init__(self, node: StageNode) -> None:
        self.node = node

    def _call(self, context: grpc.ServicerContext, name: str, fn: Callable[[], object]):
        try:
            return fn()
        except MeshError as error:
            logger.warning("%s refused: %s", name, error.message)
            abort_with(context, error)
        except Exception as error:  # noqa: BLE001 - mapped to INTERNAL with the reason
            logger.exception("%s failed", name)
            abort_with(context, error)

    def Claim(self, request: stage_pb2.ClaimRequest, context) -> stage_pb2.ClaimReply:
        def run() -> stage_pb2.ClaimReply:
            term = self.node.claim(ClaimRequest.from_proto(request))
            return ClaimReply(term=term, node_id=self.node.settings.node_id).to_proto()

        return self._call(context, "Claim", run)

    def Prepare(self, request: stage_pb2.PrepareRequest, context) -> stage_pb2.PrepareReply:
        def run() -> stage_pb2.PrepareReply:
            decoded = PrepareRequest.from_proto(request)
            self.node.prepare(decoded)
            return PrepareReply(term=decoded.term).to_proto()

        return self._call(context, "Prepare", run)

    def Inventory(self, request: stage_pb2.InventoryRequest, context) -> stage_pb2.InventoryReply:
        def run() -> stage_pb2.InventoryReply:
            return self.node.inventory(InventoryRequest.from_proto(request).term).to_proto()

        return self._call(context, "Inventory", run)

    def Load(self, request: stage_pb2.StageLoadRequest, context) -> stage_pb2.Ready:
        def run() -> stage_pb2.Ready:
            try:
                return self.node.load(StageLoadRequest.from_proto(request)).to_proto()
            except Exception:
                self.node.metrics.load_failures.inc()
                raise

        return self._call(context, "Load", run)

    def ProbeLink(self, request: stage_pb2.ProbeLinkRequest, context) -> stage_pb2.ProbeLinkReply:
        def run() -> stage_pb2.ProbeLinkReply:
            decoded = ProbeLinkRequest.from_proto(request)
            error = probe_link(decoded.address, PROBE_TIMEOUT_S)
            if error:
                logger.warning("a data link to %s could not be opened: %s", decoded.address, error)
            return ProbeLinkReply(error=error).to_proto()

        return self._call(context, "ProbeLink", run)

    def Release(self, request: stage_pb2.ReleaseRequest, context) -> stage_pb2.ReleaseReply:
        def run() -> stage_pb2.ReleaseReply:
            decoded = ReleaseRequest.from_proto(request)
            self.node.release(decoded.term, decoded.reason or "released by the coordinator")
            return ReleaseReply(term=self.node.term).to_proto()

        return self._call(context, "Release", run)


class DataServicer(data_pb2_grpc.StageDataServicer):
    """Forward frames in; Return results in (stage 0 only)."""

    def __init__(self, node: StageNode, on_result: Callable[[FrameResult], None]) -> None:
        self.node = node
        self.on_result = on_result
        # This stage's framed TCP listener (stage/tcp_data.py), once it listens.
        self.tcp_endpoint = ""
        self.tcp_tls = False
        # Set on stage 0: why Forward links (TCP or gRPC) are refused.
        self.forward_refusal = ""
        # This stage's framed TCP listener (None: frames come over gRPC only), and
        # the ack queues of the gRPC Forward streams open now.
        self.tcp: TcpDataServer | None = None
        self._forward_acks: set[queue.SimpleQueue] = set()
        node.on_load_change(self._on_load_change)
        node.on_downstream_broken(self._end_forward_links)
        self._open = {"Forward": 0, "Return": 0}
        self._open_lock = threading.Lock()

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        """The stage let go of its layers: close the Forward links into it. They
        belong to the term it served (an upstream stage of a later term opens its
        own after this stage loads that term), and an upstream stage still serving
        that term would otherwise send frames nobody answers (this stage's refusals
        go back on a Return link it has closed too): the link's end tells it at once
        (stage 0: its requests wait for the next pipeline, /health says 503)."""
        if loaded is None:
            self._end_forward_links(f"node {self.node.settings.node_id} let go of its layers")

    def _end_forward_links(self, reason: str) -> None:
        """Close the Forward links into this stage (TCP and gRPC), saying ``reason``.
        Also when this stage's own link to the next stage broke: nothing it is sent
        can go on, and the break travels up to stage 0 (its /health says 503, its new
        requests wait for the next pipeline) even while no coordinator acts."""
        if self.tcp is not None:
            self.tcp.end_links(KIND_FORWARD, reason)
        with self._open_lock:
            streams = list(self._forward_acks)
        for acks in streams:
            acks.put(_END)
        if streams:
            logger.warning("ending %d upstream Forward stream(s): %s", len(streams), reason)

    @property
    def max_message_bytes(self) -> int:
        """The largest framed TCP message this stage reads (its frame limit and slack)."""
        return self.node.settings.max_frame_bytes + MESSAGE_SLACK_BYTES

    def _open_stream(self, kind: str, context: grpc.ServicerContext) -> None:
        """Count a new stream of ``kind``; abort it when the stage has its fill."""
        if kind == "Forward" and self.forward_refusal:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.forward_refusal)
        with self._open_lock:
            full = self._open[kind] >= MAX_STREAMS[kind]
            if not full:
                self._open[kind] += 1
        if full:
            logger.warning("refused a %s stream: %d already open", kind, MAX_STREAMS[kind])
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this stage already has {MAX_STREAMS[kind]} {kind} streams open; close one "
                "(a stage needs one per neighbour) and retry",
            )

    def _close_stream(self, kind: str) -> None:
        with self._open_lock:
            self._open[kind] -= 1

    def Endpoint(self, request: data_pb2.EndpointRequest, context) -> data_pb2.EndpointReply:
        loaded = self.node.loaded
        return data_pb2.EndpointReply(
            tcp=self.tcp_endpoint,
            tls=self.tcp_tls,
            serving_term=loaded.request.term if loaded is not None else 0,
            forward_broken=loaded is not None and "forward" in loaded.broken_links,
        )

    def frame_bytes(self, body: bytes) -> None:
        """A Forward frame that came over framed TCP (no ack channel: a refusal goes
        to stage 0 over the Return link, as for every refused segment). A frame of a
        term this stage no longer serves closes the link (``accept``)."""
        try:
            pb = data_pb2.Frame.FromString(body)
        except Exception as error:  # noqa: BLE001 - undecodable: the sender's fault
            logger.warning("undecodable frame over framed TCP refused: %s", error)
            return
        end = self.accept(pb, None)
        if end:
            raise EndLink(end)

    def result_bytes(self, body: bytes) -> None:
        """A FrameResult that came over framed TCP (stage 0)."""
        try:
            pb = data_pb2.FrameResult.FromString(body)
        except Exception as error:  # noqa: BLE001 - undecodable: the sender's fault
            logger.warning("undecodable result over framed TCP refused: %s", error)
            return
        self.node.metrics.received["return"].count(len(body))
        self.on_result(result_from_proto(pb))

    def Forward(self, request_iterator: Iterator[data_pb2.Frame], context) -> Iterator:
        self._open_stream("Forward", context)
        acks: queue.SimpleQueue = queue.SimpleQueue()
        with self._open_lock:
            self._forward_acks.add(acks)
        try:
            reader = NamedThread(
                target=self._read_frames,
                args=(request_iterator, acks),
                name="data-reader",
                daemon=True,
            )
            reader.start()
            while True:
                ack = acks.get()
                if ack is _END:
                    return
                yield ack_to_proto(ack)
        finally:
            with self._open_lock:
                self._forward_acks.discard(acks)
            self._close_stream("Forward")

    def _read_frames(self, request_iterator: Iterator[data_pb2.Frame], acks) -> None:
        try:
            for pb in request_iterator:
                end = self.accept(pb, acks.put)
                if end:
                    logger.warning("ending an upstream Forward stream: %s", end)
                    return
        except grpc.RpcError as error:
            logger.info("upstream Forward stream ended: %s", rpc_status_name(error))
        except Exception:  # noqa: BLE001 - the stream ends, the stage stays up
            logger.exception("Forward stream reader failed")
        finally:
            acks.put(_END)

    def accept(self, pb: data_pb2.Frame, send_ack: Callable[[FrameAck], None] | None) -> str:
        """Validate, decode and queue a Forward frame; ``send_ack`` (None: none)
        tells the upstream stage when the whole frame was refused. Returns why the
        link it came on should be closed ("": it should not): its term is one this
        stage will never answer again (``_term_over``)."""
        self.node.metrics.received["forward"].count(pb.ByteSize())
        end = self._term_over(pb.term)
        self._accept(pb, send_ack)
        return end

    def _term_over(self, term: int) -> str:
        """Why this stage will never answer a frame of ``term`` (""): it let go of
        that term's layers (the coordinator released them, or fenced this stage) or
        serves a newer term. The upstream stage that sends it is left out of the
        pipeline that replaced it, and would wait for answers that never come (its
        refusals travel on a Return link that is closed too), so its link is closed:
        the link's end tells it at once (stage 0: its requests wait for the new
        pipeline, its /health says 503)."""
        loaded = self.node.loaded
        node_id = self.node.settings.node_id
        if loaded is None:
            if 0 < term <= self.node.term:
                return f"node {node_id} let go of the layers of term {term}"
            return ""
        if term < loaded.request.term:
            return f"node {node_id} serves term {loaded.request.term}, not term {term}"
        return ""

    def _accept(self, pb: data_pb2.Frame, send_ack: Callable[[FrameAck], None] | None) -> None:
        loaded = self.node.loaded
        try:
            if loaded is None:
                raise Unavailable(
                    f"node {self.node.settings.node_id} has no layers loaded; retry after reload"
                )
            runtime = loaded.engine.runtime
            problems = validate_frame(
                pb,
                hidden_size=runtime.hidden_size,
                expects_hidden=not runtime.is_first,
                allowed_dtypes=self.node.settings.allowed_wire_dtypes,
                max_frame_bytes=self.node.settings.max_frame_bytes,
                max_tokens=self.node.settings.max_frame_tokens,
            )
            frame = frame_from_proto(pb, hidden_dtype=runtime.torch_dtype, skip=problems)
        except MeshError as error:
            self._refuse(pb, range(len(pb.segments)), error, send_ack)
            return
        except Exception as error:  # noqa: BLE001 - an undecodable frame is the sender's fault
            error = InvalidRequest(f"undecodable frame: {error}")
            self._refuse(pb, range(len(pb.segments)), error, send_ack)
            return
        for index, problem in problems.items():
            self._refuse(pb, [index], problem, None)
        if frame.segments:
            self.node.accept_frame(frame, send_ack)

    def _refuse(self, pb: data_pb2.Frame, indices, error: MeshError, send_ack) -> None:
        """Answer the segments at ``indices`` of ``pb`` with ``error`` (stage 0 hears
        it over the Return stream); ``send_ack`` tells the upstream stage when the
        whole frame was refused."""
        logger.warning("frame %s of term %s refused: %s", pb.frame_id, pb.term, error)
        loaded = self.node.loaded
        index = loaded.request.stage_index if loaded is not None else 0
        if send_ack is not None:
            send_ack(FrameAck(pb.frame_id, ErrorInfo.from_exception(error, stage_index=index)))
        if loaded is None or loaded.request.is_first or loaded.returns is None:
            return
        failures = tuple(refused_segment(pb.segments[i], error, index) for i in indices)
        if not failures:
            return
        # The refusal answers this frame: it carries the frame's term.
        result = FrameResult(pb.term, pb.frame_id, failures)
        try:
            loaded.returns.send(result_to_proto(result))
        except MeshError:
            logger.warning("cannot report the refusal of frame %s to stage 0", pb.frame_id)

    def Return(self, request_iterator: Iterator[data_pb2.FrameResult], context):
        self._open_stream("Return", context)
        try:
            received = self.node.metrics.received["return"]
            for pb in request_iterator:
                received.count(pb.ByteSize())
                self.on_result(result_from_proto(pb))
        except grpc.RpcError as error:
            logger.info("Return stream ended: %s", rpc_status_name(error))
        finally:
            self._close_stream("Return")
        return data_pb2.ReturnAck()
