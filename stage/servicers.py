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
    Frame,
    FrameAck,
    InventoryRequest,
    PrepareReply,
    PrepareRequest,
    ReleaseReply,
    ReleaseRequest,
    ReturnAck,
    StageLoadRequest,
    TokenResult,
    validate_frame,
)
from mesh.errors import InvalidRequest, MeshError, Unavailable
from mesh.grpc_util import abort_with, rpc_status_name
from mesh.proto.v1 import data_pb2, data_pb2_grpc, stage_pb2, stage_pb2_grpc
from stage.node import StageNode

logger = logging.getLogger(__name__)

_END = object()


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
        return self._call(
            context, "Load", lambda: self.node.load(StageLoadRequest.from_proto(request)).to_proto()
        )

    def Release(self, request: stage_pb2.ReleaseRequest, context) -> stage_pb2.ReleaseReply:
        def run() -> stage_pb2.ReleaseReply:
            decoded = ReleaseRequest.from_proto(request)
            self.node.release(decoded.term, decoded.reason or "released by the coordinator")
            return ReleaseReply(term=self.node.term).to_proto()

        return self._call(context, "Release", run)


class DataServicer(data_pb2_grpc.StageDataServicer):
    """Forward frames in; Return results in (stage 0 only)."""

    def __init__(self, node: StageNode, on_result: Callable[[TokenResult], None]) -> None:
        self.node = node
        self.on_result = on_result

    def Forward(self, request_iterator: Iterator[data_pb2.Frame], context) -> Iterator:
        acks: queue.SimpleQueue = queue.SimpleQueue()
        reader = threading.Thread(
            target=self._read_frames, args=(request_iterator, acks), daemon=True
        )
        reader.start()
        while True:
            ack = acks.get()
            if ack is _END:
                return
            yield ack.to_proto()

    def _read_frames(self, request_iterator: Iterator[data_pb2.Frame], acks) -> None:
        try:
            for pb in request_iterator:
                self._accept(pb, acks.put)
        except grpc.RpcError as error:
            logger.info("upstream Forward stream ended: %s", rpc_status_name(error))
        except Exception:  # noqa: BLE001 - the stream ends, the stage stays up
            logger.exception("Forward stream reader failed")
        finally:
            acks.put(_END)

    def _accept(self, pb: data_pb2.Frame, send_ack: Callable[[FrameAck], None]) -> None:
        loaded = self.node.loaded
        try:
            if loaded is None:
                raise Unavailable(
                    f"node {self.node.settings.node_id} has no layers loaded; retry after reload"
                )
            runtime = loaded.engine.runtime
            validate_frame(
                pb,
                hidden_size=runtime.hidden_size,
                expects_hidden=not runtime.is_first,
                allowed_dtypes=self.node.settings.allowed_wire_dtypes,
                max_frame_bytes=self.node.settings.max_frame_bytes,
                max_tokens=self.node.settings.max_frame_tokens,
            )
            frame = Frame.from_proto(pb, hidden_dtype=runtime.torch_dtype)
        except MeshError as error:
            self._refuse(pb, error, send_ack)
            return
        except Exception as error:  # noqa: BLE001 - an undecodable frame is the sender's fault
            self._refuse(pb, InvalidRequest(f"undecodable frame: {error}"), send_ack)
            return
        self.node.accept_frame(frame, send_ack)

    def _refuse(self, pb: data_pb2.Frame, error: MeshError, send_ack) -> None:
        logger.warning(
            "request %s session %s: frame refused: %s", pb.request_id, pb.session_id, error
        )
        loaded = self.node.loaded
        index = loaded.request.stage_index if loaded is not None else 0
        info = ErrorInfo.from_exception(error, stage_index=index)
        send_ack(FrameAck(pb.request_id, pb.session_id, info))
        if loaded is not None and not loaded.request.is_first and loaded.returns is not None:
            result = TokenResult(
                request_id=pb.request_id,
                session_id=pb.session_id,
                pos_start=pb.pos_start,
                error=info,
                # The refusal answers this frame: it carries the frame's term.
                term=pb.term,
            )
            try:
                loaded.returns.send(result.to_proto())
            except MeshError:
                logger.warning("cannot report the refusal of %s to stage 0", pb.request_id)

    def Return(self, request_iterator: Iterator[data_pb2.TokenResult], context):
        try:
            for pb in request_iterator:
                self.on_result(TokenResult.from_proto(pb))
        except grpc.RpcError as error:
            logger.info("Return stream ended: %s", rpc_status_name(error))
        return ReturnAck().to_proto()
