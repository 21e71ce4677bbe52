"""Framed TCP: the stages' lean data transport (docs/protocol.md, "Framed TCP").

The gRPC streams of ``StageData`` cost a hop several thread hand-offs in each
process (a request-iterator thread on the sender, the server's polling thread and a
stream reader on the receiver) and about 1.5 ms of CPU per token per stage on the
2-core machine of docs/benchmarks.md. Here a link is one TCP connection (TLS when
the mesh has certificates) that carries the same protobuf messages, each behind a
4-byte length:

- the sender writes a message from the thread that produced it (the stage's frame
  worker), under a lock, with no queue in between unless a delay is injected;
- the receiver runs one reader thread per connection that decodes each message and
  hands it to the same code the gRPC servicer calls.

A connection opens with a hello (magic, kind, join token), which the listener
answers with one status byte (and a reason when it refuses). After that the data
flows one way only: the receiver never writes again, so a TLS connection is never
read and written from two threads at once. The sender learns that the peer went
away by watching its socket for readability (end of stream), and that it stopped
reading by a send that times out.
"""

from __future__ import annotations

import hmac
import logging
import queue
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mesh.errors import Unavailable
from mesh.netaddr import split_host_port, url_host
from mesh.security import REFUSED_MESSAGE, MeshSecurity, active, check_token
from mesh.threads import NamedThread

if TYPE_CHECKING:
    from stage.metrics import LinkTraffic

logger = logging.getLogger(__name__)

MAGIC = b"MESHDAT1"
KIND_FORWARD = 1
KIND_RETURN = 2
KIND_NAMES = {KIND_FORWARD: "forward", KIND_RETURN: "return"}
ACCEPTED = 0
REFUSED = 1
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # as the gRPC channels' limit
CONNECT_TIMEOUT_S = 10.0
# The whole hello (TLS handshake included) must arrive within this: a peer that
# trickles it byte by byte is cut off at the deadline, not at each byte's timeout.
HELLO_TIMEOUT_S = 10.0
# A stage has one upstream and (stage 0) one Return link per later stage; links are
# reopened after failures, so the caps leave room, but a flood of connections (or of
# connections that never finish their hello) cannot take every thread and socket.
MAX_CONNECTIONS = 128
MAX_PENDING_HELLOS = 16
# Buffers for a message grow as its bytes arrive (a length alone allocates at most
# this much), so a peer cannot make the listener allocate what it never sends.
_EAGER_BYTES = 1 << 20
_REFUSALS_LOGGED_EVERY_S = 10.0
# A peer that takes nothing from its socket for this long (stopped, hung) breaks the link.
SEND_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("<I")
_HELLO = struct.Struct("<8sBH")  # magic, kind, token length
_WATCH = select.POLLIN | select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0)


class EndLink(Exception):  # noqa: N818 - not an error: the handler's verdict
    """Raised by a message handler: close this link (the message says why)."""


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive probes and a limit on unacknowledged data, so that
    a silent dead host (or a cut link) is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", 10),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 2),
        # Data the peer's host has not acknowledged for this long ends the connection.
        ("TCP_USER_TIMEOUT", int(SEND_TIMEOUT_S * 1000)),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _ReceivedBytes:
    """Bytes this process has read from its data links: heartbeats carry it, so that
    a frame still arriving over a slow link is not taken for a stuck stage. Updated
    without a lock (a lost increment only delays the figure; it never stops
    growing while bytes arrive)."""

    total = 0


def received_bytes() -> int:
    """Bytes read from this process's framed TCP data links so far."""
    return _ReceivedBytes.total


def _read_exact(sock: socket.socket, size: int) -> memoryview:
    if size > _EAGER_BYTES:
        return _read_growing(sock, size)
    buffer = memoryview(bytearray(size))
    got = 0
    while got < size:
        count = sock.recv_into(buffer[got:])
        if not count:
            raise EOFError("the peer closed the connection")
        got += count
        _ReceivedBytes.total += count
    return buffer


def _read_growing(sock: socket.socket, size: int) -> memoryview:
    """``size`` bytes into a buffer that doubles as they arrive (from ``_EAGER_BYTES``),
    so memory follows the bytes received, not the length announced."""
    buffer = bytearray(_EAGER_BYTES)
    got = 0
    while got < size:
        if got == len(buffer):
            buffer.extend(bytes(min(len(buffer), size - len(buffer))))
        with memoryview(buffer) as view:
            count = sock.recv_into(view[got:])
        if not count:
            raise EOFError("the peer closed the connection")
        got += count
        _ReceivedBytes.total += count
    return memoryview(buffer)


def server_context(security: MeshSecurity) -> ssl.SSLContext | None:
    """The listener's TLS context (the mesh's certificate; client certificates
    required under mutual TLS), or None for plaintext."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(security.tls_cert), str(security.tls_key))
    if security.tls_mutual:
        context.load_verify_locations(cafile=str(security.tls_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(security: MeshSecurity) -> ssl.SSLContext:
    """A sender's TLS context: the peer's certificate checked against the mesh's CA
    (or the system's) and its host name; this node's certificate presented."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if security.tls_ca is not None:
        context.load_verify_locations(cafile=str(security.tls_ca))
    else:
        context.load_default_certs()
    if security.tls_cert is not None and security.tls_key is not None:
        context.load_cert_chain(str(security.tls_cert), str(security.tls_key))
    return context


class TcpDataServer:
    """Accepts framed TCP links and hands their messages to ``on_frame`` (Forward)
    and ``on_result`` (Return), each given the message's bytes.

    ``max_message_bytes``: a longer message closes its link. ``forward_refusal``:
    when set, Forward links are refused with this reason (stage 0 takes none).
    At most ``max_connections`` links, of which ``max_pending_hellos`` still in
    their hello; connections past either cap are closed at once."""

    def __init__(
        self,
        listen_host: str,
        port: int,
        on_frame: Callable[[bytes], None],
        on_result: Callable[[bytes], None],
        security: MeshSecurity | None = None,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        forward_refusal: str = "",
        max_connections: int = MAX_CONNECTIONS,
        max_pending_hellos: int = MAX_PENDING_HELLOS,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.forward_refusal = forward_refusal
        self.max_connections = max_connections
        self.max_pending_hellos = max_pending_hellos
        self.security = active() if security is None else security
        self._expected = (
            check_token(self.security.join_token, "the join token").encode()
            if self.security.join_token
            else None
        )
        self._context = server_context(self.security)
        self._handlers = {KIND_FORWARD: on_frame, KIND_RETURN: on_result}
        family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((listen_host, port))
        except OSError as error:
            self._listener.close()
            raise Unavailable(
                f"cannot listen for data on {url_host(listen_host)}:{port}: {error}; "
                "is the port in use? (--data-port)"
            ) from error
        self._listener.listen(16)
        # The accept loop wakes at least this often to cut off overdue hellos.
        self._listener.settimeout(0.5)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._links: set[socket.socket] = set()  # the accepted (raw) sockets
        self._hellos: dict[socket.socket, float] = {}  # raw socket -> its hello's deadline
        self._kinds: dict[socket.socket, int] = {}  # raw socket -> the kind of its link
        # Raw socket -> the TLS socket that took its descriptor over: shutting the raw
        # one down does nothing then (``_shut_down``).
        self._wrapped: dict[socket.socket, socket.socket] = {}
        self._dropped = 0  # connections closed at a cap, not yet logged
        self._dropped_logged = 0.0
        self._lock = threading.Lock()
        self._thread = NamedThread(target=self._accept_loop, name="data-accept", daemon=True)

    @property
    def tls(self) -> bool:
        return self._context is not None

    def start(self) -> TcpDataServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for sock in connections:
            _shut(sock)

    def end_links(self, kind: int, reason: str) -> int:
        """Close every open link of ``kind`` (its sender sees the link end); how many."""
        with self._lock:
            ending = [raw for raw, of in self._kinds.items() if of == kind]
        for raw in ending:
            self._shut_down(raw)
        if ending:
            logger.warning("closing %d %s link(s): %s", len(ending), KIND_NAMES[kind], reason)
        return len(ending)

    def _accept_loop(self) -> None:
        while not self._closed:
            self._cut_overdue_hellos()
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of file descriptors, say: try again shortly
                continue
            with self._lock:
                full = (
                    "links"
                    if len(self._links) >= self.max_connections
                    else "hellos"
                    if len(self._hellos) >= self.max_pending_hellos
                    else ""
                )
                if not full:
                    self._links.add(sock)
                    self._connections.add(sock)
                    self._hellos[sock] = time.monotonic() + HELLO_TIMEOUT_S
            if full:
                _shut(sock)
                self._note_dropped(f"{full} at their cap")
                continue
            try:
                NamedThread(
                    target=self._serve, args=(sock, peer), name="data-reader", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had: drop this one, keep accepting
                self._forget(sock)
                _shut(sock)
                self._note_dropped("no thread to serve them")
                time.sleep(0.05)

    def _cut_overdue_hellos(self) -> None:
        """Shut connections whose hello missed its deadline (their reader thread then
        sees the end and closes them)."""
        now = time.monotonic()
        with self._lock:
            overdue = [sock for sock, due in self._hellos.items() if due <= now]
            for sock in overdue:
                del self._hellos[sock]
        for sock in overdue:
            self._shut_down(sock)
        if overdue:
            self._note_dropped("their hello was not done within the deadline", len(overdue))

    def _shut_down(self, raw: socket.socket) -> None:
        """Shut connection ``raw`` down for both directions: its reader thread sees the
        end and closes it. Through the socket that holds its descriptor (with TLS, the
        raw one holds none: before, a TLS link stayed open), and with the plain
        socket's shutdown (the TLS one's would drop its TLS state under the reader)."""
        with self._lock:
            live = self._wrapped.get(raw, raw)
        try:
            socket.socket.shutdown(live, socket.SHUT_RDWR)
        except OSError:
            pass

    def _note_dropped(self, why: str, count: int = 1) -> None:
        """Count connections closed unserved; log them at most once per interval."""
        now = time.monotonic()
        with self._lock:
            self._dropped += count
            if now - self._dropped_logged < _REFUSALS_LOGGED_EVERY_S:
                return
            dropped, self._dropped, self._dropped_logged = self._dropped, 0, now
        logger.warning(
            "closed %d data connection(s) unserved (latest: %s; at most %d links, %d in "
            "their hello, %.0fs per hello)",
            dropped,
            why,
            self.max_connections,
            self.max_pending_hellos,
            HELLO_TIMEOUT_S,
        )

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._connections.discard(sock)
                self._links.discard(sock)
                self._hellos.pop(sock, None)
                self._kinds.pop(sock, None)
                self._wrapped.pop(sock, None)

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        raw = sock
        kind: int | None = None
        try:
            _tune(sock)
            sock.settimeout(HELLO_TIMEOUT_S)
            if self._context is not None:
                sock = self._context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                with self._lock:
                    self._connections.add(sock)
                    self._wrapped[raw] = sock
                sock.do_handshake()  # within the hello's deadline too
            kind = self._hello(sock, where)
            with self._lock:
                on_time = self._hellos.pop(raw, None) is not None
            if kind is None or not on_time:
                return
            with self._lock:
                self._kinds[raw] = kind
            sock.settimeout(None)
            handle = self._handlers[kind]
            while not self._closed:
                (size,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
                if size > self.max_message_bytes:
                    logger.warning(
                        "%s link from %s sent a %d-byte message (limit %d); closing it",
                        KIND_NAMES[kind],
                        where,
                        size,
                        self.max_message_bytes,
                    )
                    return
                handle(bytes(_read_exact(sock, size)))
        except EndLink as end:
            logger.warning("closing the data link from %s: %s", where, end)
        except (EOFError, OSError, ssl.SSLError) as error:
            if self._closed:
                pass
            elif kind is None and isinstance(error, (EOFError, ssl.SSLEOFError)):
                # Closed before its hello: a reachability check (the coordinator's,
                # before it plans a stage in; ``doctor``'s), not a link.
                logger.debug("connection from %s closed before its hello", where)
            else:
                logger.info("data link from %s ended: %s", where, error or type(error).__name__)
        except Exception:  # noqa: BLE001 - the link ends, the stage stays up
            logger.exception("data link from %s failed", where)
        finally:
            self._forget(sock, raw)
            _shut(sock)
            if sock is not raw:
                _shut(raw)

    def _hello(self, sock: socket.socket, where: str) -> int | None:
        """The kind of link ``sock`` opens, after answering its hello; None (and a
        refusal sent) when it may not."""
        magic, kind, token_size = _HELLO.unpack(_read_exact(sock, _HELLO.size))
        if magic != MAGIC or kind not in self._handlers:
            _refuse(sock, "not a mesh data link (wrong magic or kind); wrong port?")
            logger.warning("refused a data link from %s: not a mesh data link", where)
            return None
        token = bytes(_read_exact(sock, token_size)) if token_size else b""
        if self._expected is not None and not hmac.compare_digest(token, self._expected):
            _refuse(sock, REFUSED_MESSAGE)
            logger.warning(
                "refused a %s link from %s: %s", KIND_NAMES[kind], where, REFUSED_MESSAGE
            )
            return None
        if kind == KIND_FORWARD and self.forward_refusal:
            _refuse(sock, self.forward_refusal)
            logger.warning("refused a forward link from %s: %s", where, self.forward_refusal)
            return None
        sock.sendall(bytes([ACCEPTED]))
        logger.info("%s link from %s open", KIND_NAMES[kind], where)
        return kind


def _refuse(sock: socket.socket, reason: str) -> None:
    text = reason.encode()[:65535]
    try:
        sock.sendall(bytes([REFUSED]) + struct.pack("<H", len(text)) + text)
    except OSError:
        pass


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def sleep_until(due: float) -> None:
    """Wait until ``time.monotonic()`` reaches ``due`` (an injected hop delay)."""
    wait = due - time.monotonic()
    if wait > 0:
        time.sleep(wait)


class TcpLink:
    """One outgoing framed TCP link (Forward or Return): ``send`` writes a message
    from the calling thread; ``on_broken`` runs once when the link fails."""

    def __init__(
        self,
        endpoint: str,
        kind: int,
        on_broken: Callable[[Exception], None],
        *,
        tls: bool = False,
        delay_s: float = 0.0,
        traffic: LinkTraffic | None = None,
        security: MeshSecurity | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = endpoint
        self.name = KIND_NAMES[kind]
        self.delay_s = delay_s
        self._on_broken = on_broken
        self._traffic = traffic
        self._broken: Exception | None = None
        self._closed = False
        self._lock = threading.Lock()  # one writer at a time
        self._state = threading.Lock()  # _broken and _closed
        security = active() if security is None else security
        self._sock = self._connect(endpoint, kind, tls, security, connect_timeout_s)
        self._delayed: queue.SimpleQueue | None = None
        if delay_s > 0:
            self._delayed = queue.SimpleQueue()
            NamedThread(target=self._send_delayed, name=f"{self.name}-delay", daemon=True).start()
        NamedThread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _connect(
        self, endpoint: str, kind: int, tls: bool, security: MeshSecurity, timeout_s: float
    ) -> socket.socket:
        host, port = split_host_port(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            raise Unavailable(
                f"{self.name} link: cannot reach {endpoint} within {timeout_s:.0f}s: {error}"
            ) from error
        try:
            _tune(sock)
            if tls:
                sock = client_context(security).wrap_socket(sock, server_hostname=host)
            token = (security.join_token or "").encode()
            sock.sendall(_HELLO.pack(MAGIC, kind, len(token)) + token)
            status = _read_exact(sock, 1)[0]
            if status != ACCEPTED:
                (size,) = struct.unpack("<H", _read_exact(sock, 2))
                reason = bytes(_read_exact(sock, size)).decode(errors="replace")
                raise Unavailable(f"{self.name} link to {endpoint} refused: {reason}")
            sock.settimeout(SEND_TIMEOUT_S)
        except Unavailable:
            _shut(sock)
            raise
        except (EOFError, OSError, ssl.SSLError) as error:
            _shut(sock)
            raise Unavailable(f"{self.name} link to {endpoint} failed to open: {error}") from error
        return sock

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, message: Any) -> None:
        """Send a protobuf message (raises Unavailable once the link is down)."""
        if self._broken is not None:
            raise Unavailable(f"{self.name} link to {self.address} is down: {self._broken}")
        body = message.SerializeToString()
        if self._traffic is not None:
            self._traffic.count(len(body))
        data = _LENGTH.pack(len(body)) + body
        if self._delayed is not None:
            self._delayed.put((time.monotonic() + self.delay_s, data))
            return
        self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            with self._lock:
                self._sock.sendall(data)
        except (OSError, ssl.SSLError) as error:
            if isinstance(error, TimeoutError):
                error = Unavailable(
                    f"{self.address} took nothing for {SEND_TIMEOUT_S:.0f}s (stopped or hung)"
                )
            self._fail(error)
            raise Unavailable(f"{self.name} link to {self.address} is down: {error}") from error

    def _send_delayed(self) -> None:
        while True:
            item = self._delayed.get()
            if item is None:
                return
            due, data = item
            sleep_until(due)
            try:
                self._write(data)
            except Unavailable:
                return

    def _watch(self) -> None:
        """The receiver never writes after the hello: readability means it went away."""
        poller = select.poll()
        fd = self._sock.fileno()
        if fd < 0:  # closed before this thread started
            return
        poller.register(fd, _WATCH)
        while not self._closed:
            try:
                if poller.poll(1000):
                    break
            except OSError:
                break
        self._fail(Unavailable(f"{self.name} link to {self.address} ended"))

    def _fail(self, error: Exception) -> None:
        with self._state:
            if self._closed or self._broken is not None:
                return
            self._broken = error
        logger.warning("%s link to %s broke: %s", self.name, self.address, error)
        self._on_broken(error)

    def close(self) -> None:
        with self._state:
            self._closed = True
        if self._delayed is not None:
            self._delayed.put(None)
        _shut(self._sock)
