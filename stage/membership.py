"""Joining the coordinator and keeping a heartbeat."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from mesh.codec import HeartbeatReply, HeartbeatRequest, JoinReply, JoinRequest
from mesh.grpc_util import CONTROL_DEADLINE_S, channel
from mesh.proto.v1 import coordinator_pb2_grpc
from mesh.security import active, unavailable_hint
from mesh.threads import NamedThread

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
# Retrying an unreachable coordinator: the wait doubles from the first to the last.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 5.0
# The least time between two heartbeats, however often something asks for one now.
MIN_BEAT_GAP_S = 0.25
# With ``relocate`` (``--coordinator auto``): how long the coordinator may be
# unreachable before the stage looks for one on its networks again, and how often.
RELOCATE_AFTER_S = 15.0


class Membership:
    """Joins with ``join_request`` and heartbeats until stopped; rejoins when the
    coordinator forgets the node or restarts. Every reply's term goes to
    ``on_term``. While the coordinator cannot be reached it retries with a doubling
    wait (up to RETRY_MAX_S) and logs the outage once, not every beat.

    With ``relocate`` (a stage that found its coordinator by LAN discovery), an
    outage of RELOCATE_AFTER_S makes it look again (``relocate`` returns the address
    of the one coordinator answering, or None) every RELOCATE_AFTER_S; when one
    answers at another address the stage joins it there and ``on_moved`` hears the
    new address (the coordinator came back on another host or address)."""

    def __init__(
        self,
        coordinator: str,
        join_request: Callable[[], JoinRequest],
        heartbeat: Callable[[], HeartbeatRequest],
        on_term: Callable[[int], None] | None = None,
        relocate: Callable[[], str | None] | None = None,
        on_moved: Callable[[str], None] | None = None,
        on_superseded: Callable[[str], None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self._join_request = join_request
        self._heartbeat = heartbeat
        self._on_term = on_term
        self._relocate = relocate
        self._on_moved = on_moved
        self._on_superseded = on_superseded
        # The address of the last Join, sent with every heartbeat; and, once another
        # process has joined with this node id, that process's address.
        self._address = ""
        self.superseded_by = ""
        self._next_search = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._channel = channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._interval_s = DEFAULT_HEARTBEAT_S
        self._retry_s = RETRY_FIRST_S
        self._outage_since: float | None = None
        self.joined = threading.Event()
        self._thread = NamedThread(target=self._run, name="membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._channel.close()

    def outage_s(self) -> float:
        """Seconds since the first failed call of the outage going on now (0: the
        last call reached the coordinator)."""
        since = self._outage_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def poke(self) -> None:
        """Send the next heartbeat now (something suggests the term moved on)."""
        self._wake.set()

    def _wait(self, seconds: float) -> None:
        started = time.monotonic()
        self._wake.wait(seconds)
        self._wake.clear()
        # Pokes come with frames (one of a newer term each): however many come, a
        # heartbeat follows the last by at least MIN_BEAT_GAP_S.
        left = MIN_BEAT_GAP_S - (time.monotonic() - started)
        if left > 0:
            self._stop.wait(left)

    def _unreachable(self, what: str, error: grpc.RpcError) -> None:
        """Log the first failure of an outage; later ones only at debug level."""
        code = error.code()
        hint = (
            f"; {unavailable_hint(active(), str(error.details()))}"
            if code == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            logger.warning(
                "%s to coordinator %s failed: %s (%s)%s; retrying with backoff up to %.0fs",
                what,
                self.coordinator,
                code.name,
                error.details(),
                hint,
                RETRY_MAX_S,
            )
        else:
            logger.debug("%s to %s failed again: %s", what, self.coordinator, code.name)
        self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)

    def _moved(self) -> bool:
        """After a long enough outage, look for the coordinator again; True when it
        answered at another address, which this membership now uses."""
        if self._relocate is None or self._outage_since is None or self._stop.is_set():
            return False
        now = time.monotonic()
        if now - self._outage_since < RELOCATE_AFTER_S or now < self._next_search:
            return False
        self._next_search = now + RELOCATE_AFTER_S
        address = self._relocate()
        if not address or address == self.coordinator:
            return False
        logger.warning(
            "coordinator %s unreachable for %.0fs; a coordinator answers at %s on this "
            "network: joining it there",
            self.coordinator,
            now - self._outage_since,
            address,
        )
        old = self._channel
        self.coordinator = address
        self._channel = channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        old.close()
        if self._on_moved is not None:
            self._on_moved(address)
        self._retry_s = RETRY_FIRST_S
        return True

    def _reachable(self) -> None:
        if self._outage_since is not None:
            logger.info(
                "coordinator %s reachable again after %.1fs",
                self.coordinator,
                time.monotonic() - self._outage_since,
            )
        self._outage_since = None
        self._retry_s = RETRY_FIRST_S

    def _join(self) -> bool:
        request = self._join_request()
        try:
            reply = JoinReply.from_proto(
                self._stub.Join(request.to_proto(), timeout=CONTROL_DEADLINE_S)
            )
        except grpc.RpcError as error:
            if self._stop.is_set():
                return False
            self._unreachable("join", error)
            return False
        self._reachable()
        self._address = request.address
        if reply.heartbeat_interval_ms:
            self._interval_s = reply.heartbeat_interval_ms / 1000.0
        logger.info(
            "joined coordinator %s (%s) as %s at %s (holding term %s)",
            self.coordinator,
            reply.coordinator_id,
            request.node_id,
            request.address,
            request.term,
        )
        self.joined.set()
        return True

    def _run(self) -> None:
        joined = False
        while not self._stop.is_set():
            try:
                joined = self._step(joined)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any one beat
                # An exception here would end the thread silently: the coordinator
                # would take this live stage for dead, forever.
                logger.exception("heartbeat to %s failed; trying again", self.coordinator)
                self._wait(self._retry_s)

    def _give_up_id(self, node_id: str, taken_by: str) -> None:
        """Another process joined with this node id after this one: serve nothing, and
        keep heartbeating without taking the id back (which would only pass it to and
        fro); the coordinator asks this process to join again once that one is dead."""
        if self.superseded_by == taken_by:
            return
        self.superseded_by = taken_by
        logger.error(
            "the process at %s joined the coordinator as node %s after this one; this "
            "process serves nothing while that one lives (it takes the id back if that "
            "process dies). Two processes must not share a node id: give each stage its "
            "own --node-id (or --cache-dir, from which the default id is made)",
            taken_by,
            node_id,
        )
        if self._on_superseded is not None:
            self._on_superseded(taken_by)

    def _step(self, joined: bool) -> bool:
        """One join attempt or one heartbeat (and the wait after it); whether the
        node is joined afterwards."""
        if not joined:
            if self._join():
                return True
            if not self._moved():
                self._wait(self._retry_s)
            return False
        beat = replace(self._heartbeat(), address=self._address)
        try:
            reply = HeartbeatReply.from_proto(
                self._stub.Heartbeat(beat.to_proto(), timeout=CONTROL_DEADLINE_S)
            )
        except grpc.RpcError as error:
            if self._stop.is_set():
                return True
            self._unreachable("heartbeat", error)
            if self._moved():
                return False
            self._wait(self._retry_s)
            return True
        self._reachable()
        if not reply.known:
            logger.info("coordinator does not know this node; joining again")
            return False
        if reply.superseded_by:
            self._give_up_id(beat.node_id, reply.superseded_by)
            self._wait(self._interval_s)
            return True
        if self.superseded_by:
            logger.info("node %s is this process's again", beat.node_id)
            self.superseded_by = ""
        if self._on_term is not None:
            self._on_term(reply.term)
        self._wait(self._interval_s)
        return True
