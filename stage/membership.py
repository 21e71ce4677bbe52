"""Joining the coordinator and keeping a heartbeat."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from mesh.codec import HeartbeatReply, HeartbeatRequest, JoinReply, JoinRequest
from mesh.grpc_util import CONTROL_DEADLINE_S, channel
from mesh.proto.v1 import coordinator_pb2_grpc
from mesh.security import active, unavailable_hint

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
RETRY_S = 1.0


class Membership:
    """Joins with ``join_request`` and heartbeats until stopped; rejoins when the
    coordinator forgets the node or restarts."""

    def __init__(
        self,
        coordinator: str,
        join_request: JoinRequest,
        heartbeat: Callable[[], HeartbeatRequest],
    ) -> None:
        self.coordinator = coordinator
        self.join_request = join_request
        self._heartbeat = heartbeat
        self._stop = threading.Event()
        self._channel = channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._interval_s = DEFAULT_HEARTBEAT_S
        self.joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._channel.close()

    def _join(self) -> bool:
        try:
            reply = JoinReply.from_proto(
                self._stub.Join(self.join_request.to_proto(), timeout=CONTROL_DEADLINE_S)
            )
        except grpc.RpcError as error:
            logger.warning(
                "cannot join coordinator %s: %s (%s)%s",
                self.coordinator,
                error.code().name,
                error.details(),
                f"; {unavailable_hint(active())}"
                if error.code() == grpc.StatusCode.UNAVAILABLE
                else "",
            )
            return False
        if reply.heartbeat_interval_ms:
            self._interval_s = reply.heartbeat_interval_ms / 1000.0
        logger.info(
            "joined coordinator %s (%s) as %s at %s",
            self.coordinator,
            reply.coordinator_id,
            self.join_request.node_id,
            self.join_request.address,
        )
        self.joined.set()
        return True

    def _run(self) -> None:
        joined = False
        while not self._stop.is_set():
            if not joined:
                joined = self._join()
                if not joined:
                    self._stop.wait(RETRY_S)
                    continue
            try:
                reply = HeartbeatReply.from_proto(
                    self._stub.Heartbeat(self._heartbeat().to_proto(), timeout=CONTROL_DEADLINE_S)
                )
                if not reply.known:
                    logger.info("coordinator does not know this node; joining again")
                    joined = False
                    continue
            except grpc.RpcError as error:
                if self._stop.is_set():
                    return
                logger.warning("heartbeat to %s failed: %s", self.coordinator, error.code().name)
            self._stop.wait(self._interval_s)
