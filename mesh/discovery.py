"""Finding the coordinator on a local network: ``mesh-stage join --coordinator auto``.

``mesh-coordinator up`` answers discovery queries on UDP at its gRPC port (7070/udp
by default; ``--no-discovery`` turns it off). A stage started with ``--coordinator
auto`` (or ``auto:PORT``) broadcasts a query on every IPv4 network it is on and
joins the coordinator that answers: at the address the coordinator advertises when
it was given one (``--advertise``, needed with TLS: the name on its certificate),
else at the address the answer came from.

Query and answer are one JSON datagram each::

    {"kind": "mesh-discover", "v": 1, "nonce": "<32 hex>"}
    {"kind": "mesh-coordinator", "v": 1, "nonce": "<the query's>", "id": "coord-...",
     "port": 7070, "host": "<advertised host or empty>", "model": "<model id>",
     "tls": false, "token": true, "mac": "<hex>"}

With a join token the answer carries ``mac``, an HMAC-SHA256 keyed by the token
over the answer's other fields (canonical JSON), and a stage that has the token
joins only a coordinator whose answer proves it knows the token too: a host that
answers queries in a coordinator's place cannot make a stage send it its token.
Without a token anyone who can reach the mesh can join it, and discovery adds no
exposure beyond that; on networks you do not trust, use a token (and TLS) or name
the coordinator. The query also goes to 127.0.0.1, where a coordinator on the
stage's own host answers (one listening on loopback only, as ``make serve``'s).
A coordinator that answers on several networks (or on loopback too) is one offer,
by its id; when several coordinators answer, the stage stops and lists them: name
one with ``--coordinator HOST:PORT``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh.errors import InvalidRequest
from mesh.netaddr import broadcast_addresses, is_loopback, is_wildcard, url_host

logger = logging.getLogger(__name__)

VERSION = 1
QUERY = "mesh-discover"
ANSWER = "mesh-coordinator"
DEFAULT_PORT = 7070
MAX_DATAGRAM = 2048
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Offer:
    """A coordinator's answer."""

    address: str  # HOST:PORT to join
    coordinator_id: str
    model_id: str
    tls: bool
    token: bool


def _canonical(fields: dict[str, object]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _mac(token: str, fields: dict[str, object]) -> str:
    return hmac.new(token.encode(), _canonical(fields), hashlib.sha256).hexdigest()


def _message(data: bytes, kind: str) -> dict[str, object] | None:
    """The JSON object of a datagram of ``kind`` and this version, or None."""
    try:
        fields = json.loads(data.decode())
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deep
        return None
    if not isinstance(fields, dict) or fields.get("kind") != kind or fields.get("v") != VERSION:
        return None
    return fields


def answer_for(
    query: bytes,
    port: int,
    model_id: str,
    host: str,
    tls: bool,
    token: str | None,
    coordinator_id: str = "",
) -> bytes | None:
    """The answer datagram to ``query``, or None when it is not a discovery query."""
    asked = _message(query, QUERY)
    if asked is None:
        return None
    nonce = asked.get("nonce")
    if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
        return None
    fields: dict[str, object] = {
        "kind": ANSWER,
        "v": VERSION,
        "nonce": nonce,
        "id": coordinator_id,
        "port": port,
        "host": host,
        "model": model_id,
        "tls": tls,
        "token": token is not None,
    }
    fields["mac"] = _mac(token, fields) if token is not None else ""
    return _canonical(fields)


def read_answer(
    data: bytes, source: str, nonce: str, token: str | None, refused: set[str] | None = None
) -> Offer | None:
    """The offer in an answer datagram from ``source``, or None when it is not an
    answer to this query or (with a token) does not prove the coordinator has it
    (then ``source`` joins ``refused``, and the warning is logged once per source)."""
    fields = _message(data, ANSWER)
    if fields is None or fields.get("nonce") != nonce:
        return None
    port, host, mac = fields.get("port"), fields.get("host"), fields.pop("mac", "")
    if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(host, str):
        return None
    needs_token = fields.get("token") is True
    if token is not None:
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(token, fields)):
            if refused is None or source not in refused:
                logger.warning(
                    "ignoring a discovery answer from %s: it does not prove this node's "
                    "join token (a coordinator with another token: check MESH_JOIN_TOKEN "
                    "or --join-token-file; or a host answering in a coordinator's place)",
                    source,
                )
            if refused is not None:
                refused.add(source)
            return None
    elif needs_token:
        logger.warning(
            "the coordinator at %s needs a join token: give this stage the mesh's token "
            "(MESH_JOIN_TOKEN or --join-token-file)",
            source,
        )
        return None
    return Offer(
        address=f"{url_host(host or source)}:{port}",
        coordinator_id=str(fields.get("id", "")),
        model_id=str(fields.get("model", "")),
        tls=fields.get("tls") is True,
        token=needs_token,
    )


class DiscoveryResponder:
    """Answers discovery queries on UDP ``host:port`` in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        model_id: Callable[[], str],
        advertise: str,
        tls: bool,
        token: str | None,
        coordinator_id: str = "",
    ) -> None:
        self._id = coordinator_id
        # Queries are broadcasts, which a socket bound to one unicast address never
        # receives: only a coordinator on loopback binds its address (it must not
        # answer another host). One listening on a single address of a network
        # answers on every network and names that address, where its gRPC listens.
        self._bind = (host if is_loopback(host) else "", port)
        self._port = port
        self._model_id = model_id
        self._advertise = advertise or (
            "" if is_wildcard(host) or is_loopback(host) else host.strip("[]")
        )
        self._tls = tls
        self._token = token
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Listen; False (logged) when the port cannot be had: serving goes on
        without discovery."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(self._bind)
        except OSError as error:
            sock.close()
            logger.warning(
                "LAN discovery is off: cannot listen on UDP %s:%s (%s); stages must be "
                "given --coordinator HOST:PORT",
                self._bind[0] or "0.0.0.0",
                self._port,
                error.strerror,
            )
            return False
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="discovery", daemon=True)
        self._thread.start()
        logger.info("answering LAN discovery on UDP port %s", self._port)
        return True

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                query, source = sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                answer = answer_for(
                    query,
                    self._port,
                    self._model_id(),
                    self._advertise,
                    self._tls,
                    self._token,
                    self._id,
                )
            except Exception:  # noqa: BLE001 - one datagram must not end the answers
                logger.exception("discovery query from %s could not be answered", source[0])
                continue
            if answer is None:
                continue
            try:
                sock.sendto(answer, source)
            except OSError as error:
                logger.debug("cannot answer discovery from %s: %s", source[0], error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()


def discover(
    port: int,
    token: str | None,
    wait_s: float,
    targets: Sequence[str] | None = None,
    refused: set[str] | None = None,
) -> list[Offer]:
    """Ask once (to ``targets``, by default every broadcast address of this host and
    127.0.0.1) and collect the offers that come within ``wait_s``, one per
    coordinator (the first answer of each); hosts whose answers did not prove the
    join token are added to ``refused``."""
    nonce = secrets.token_hex(16)
    query = _canonical({"kind": QUERY, "v": VERSION, "nonce": nonce})
    offers: dict[str, Offer] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind(("", 0))
        for target in targets if targets is not None else [*broadcast_addresses(), LOOPBACK]:
            try:
                sock.sendto(query, (target, port))
            except OSError as error:
                logger.debug("cannot send a discovery query to %s: %s", target, error)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data, source = sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                break
            offer = read_answer(data, source[0], nonce, token, refused)
            if offer is not None:
                offers.setdefault(offer.coordinator_id or offer.address, offer)
    return list(offers.values())


def rediscover(
    port: int, token: str | None, targets: Sequence[str] | None = None, wait_s: float = 1.0
) -> str | None:
    """One round of asking (``discover``): the address of the one coordinator that
    answered, or None (nobody, or several: logged, the caller keeps what it has)."""
    offers = discover(port, token, wait_s, targets)
    if len(offers) > 1:
        listed = ", ".join(f"{o.address} ({o.model_id})" for o in offers)
        logger.warning("several coordinators answered on UDP port %s: %s", port, listed)
        return None
    return offers[0].address if offers else None


def parse_auto(coordinator: str) -> int | None:
    """The UDP port of ``auto`` / ``auto:PORT``; None for a HOST:PORT."""
    if coordinator == "auto":
        return DEFAULT_PORT
    if coordinator.startswith("auto:"):
        port = coordinator[len("auto:") :]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest(f"--coordinator {coordinator}: give auto or auto:PORT")
        return int(port)
    return None


def find_coordinator(
    port: int,
    token: str | None,
    timeout_s: float,
    targets: Sequence[str] | None = None,
    round_s: float = 1.0,
) -> Offer:
    """Ask until a coordinator answers (for up to ``timeout_s``); its offer. Several
    coordinators answering is an error that lists them."""
    deadline = time.monotonic() + timeout_s
    said = False
    refused: set[str] = set()
    while True:
        offers = discover(port, token, round_s, targets, refused)
        if len(offers) == 1:
            return offers[0]
        if len(offers) > 1:
            listed = ", ".join(f"{o.address} ({o.model_id})" for o in offers)
            raise InvalidRequest(
                f"several coordinators answered on UDP port {port}: {listed}; "
                "name one with --coordinator HOST:PORT"
            )
        if time.monotonic() >= deadline:
            if refused:
                raise InvalidRequest(
                    f"a coordinator answered on UDP port {port} (from "
                    f"{', '.join(sorted(refused))}) but not with this node's join token: "
                    "give this node the mesh's token (MESH_JOIN_TOKEN or "
                    "--join-token-file, the same on every node)"
                )
            raise InvalidRequest(
                f"no coordinator answered on UDP port {port} within {timeout_s:g} s; is "
                "`mesh-coordinator up` running on this network (with discovery on, and "
                f"UDP {port} open)? else give --coordinator HOST:PORT"
            )
        if not said:
            logger.info("looking for a coordinator on this network (UDP port %s)", port)
            said = True
