"""The "Van": sockets and framing, and the only module of ps/ that imports zmq.

Server shard: a ROUTER bound to one address. Worker: one DEALER per server shard. Frames go
out and come in with copy=False, so tensor bytes are not copied in Python; the caller must
not modify a sent tensor until the matching reply has arrived.

Optional CurveZMQ (ps.security makes the keys): the server checks each client's public key
against its allowed/ folder through a ZAP authenticator (one per zmq context, shared by the
server sockets of that context), the client checks the server's public key, and the traffic
is encrypted. A refused client never gets a message through: its requests time out, and both
ends record why from their socket monitors (ServerTransport.events, log lines;
ClientTransport.handshake_error()).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from ps.security import ClientKeys, ServerKeys
from ps.throttle import Throttle
from ps.zmq_link import compiled_on, linked

try:
    import ps._send as _sends
except ImportError:  # not built (a copy of the tree without `pip install -e .`): pyzmq's sends
    _sends = None

log = logging.getLogger("psar.ps.transport")

DEFAULT_HWM = 1000
"""Messages queued per peer before a send blocks (then times out): bounded memory, and a
push of a few hundred keys never waits on it."""
LINGER_MS = 100
REPLY_COPY_BYTES = (1 << 20) + 1
"""A server without its compiled sends (SEND_COPY_BYTES) copies the frames it sends up to 1
MiB (below this, pyzmq's copy_threshold; its default, 64 KiB, leaves larger ones to
zero-copy). A zero-copy frame keeps what it points at
until pyzmq's collector thread, which needs the GIL, lets it go: a shard's reply points at its
key, and a key still held when the next push updates it must first move to a copy
(ps.shard.snapshots.SnapshotPool.own). 8 workers against one shard (psar bench's rows, async),
three rounds on 2 cores, GB/s through the shard: lent above 64 KiB (90 to 93% of the
push+pulls moved their key) 0.24, 0.28, 0.26 at 64 KiB and 1.78, 1.92, 2.08 at 1 MiB; copied
up to 256 KiB (23 to 25% moved) 0.27, 0.34, 0.34 and 1.53, 1.65, 1.90; copied up to 1 MiB
(none moved) 0.32, 0.34, 0.42 and 1.90, 2.04, 2.07. One worker's 1 MiB push+pull one at a
time, four pairs: ps/zmq 0.62, 0.62, 0.56, 0.67 lent against 0.56, 0.63, 0.68, 0.60 copied.
mlp-mid on 4 workers with 4 shards of their own at 1gbit (0.5 MiB keys), three pairs, median
step: ps-sync 0.381, 0.375, 0.373 s copied against 0.377, 0.401, 0.378 lent; ps-async 0.397,
0.368, 0.402 against 0.367, 0.429, 0.418, where 6 to 16 of its 384 pushes moved their key."""
SEND_COPY_BYTES = 1 << 16
"""A server with its compiled sends (ps/_send.c) copies the parts it sends up to 64 KiB, as
pyzmq's default copy_threshold does, and lends larger ones without pyzmq's collector thread:
ZeroMQ's I/O thread marks each done, and the sender lets it go at its next send or after the
transport's next receive, before the shard looks at a key again (a key a reply still points at
moves to a copy first: ps.shard.snapshots.SnapshotPool.own, in the shard's compiled path too).
On this 2-core machine a send of a 1 MiB part took 13-16 us against pyzmq's copy's 195-197,
and psar bench's one-at-a-time push+pull of 1 MiB 1615-1624 us against 1792-2200 copied (two
alternated pairs, experiments/bench/legs.py); 8 workers against one shard moved 15% of their
keys and as many bytes/s as with copies (1.47-1.62 GB/s against 1.49-1.63, three pairs). The
echo beside the shard sends through this too, and its round trip of 1 MiB fell likewise
(1170-1186 us against 1351-1609). Over inproc, which hands the parts themselves to the peer
(a client's frames would be the shard's own memory), it lends only above REPLY_COPY_BYTES,
as pyzmq's sends did."""
MONITOR_DRAIN_S = 0.05
"""A client reads its socket monitor (handshake events) on a send at most this often: a few
events per connection attempt, so the monitor never fills, and no poll on every send."""


class PeerTimeout(TimeoutError):
    """No message from a peer within the timeout; the text names the address and the wait."""


class TransportError(RuntimeError):
    """A send that could not be completed; the text names the address."""


class HandshakeRefused(PeerTimeout, TransportError):
    """A send that could not be queued because the handshake with the peer failed (CURVE keys
    or mechanism): no reply can ever come, so it is a PeerTimeout (and a TransportError)."""


def default_context() -> zmq.Context:
    """The process-wide context: inproc:// endpoints only connect within one context."""
    return zmq.Context.instance()


_started_io: int | None = None
"""The I/O threads the process-wide context started with its first socket here (None: none yet)."""


def _context_for(context: Any) -> zmq.Context:
    """context, or the process-wide one, noting that a socket of it now starts its I/O threads."""
    global _started_io
    if context is not None:
        return context
    ctx = default_context()
    if _started_io is None:
        _started_io = ctx.get(zmq.IO_THREADS)
    return ctx


def use_io_threads(count: int) -> int:
    """Run the process-wide context's connections on `count` I/O threads (ps/cores.py says how
    many a shard takes); the number it runs. ZeroMQ starts them with the context's first
    socket: after one, the number it started with stays."""
    if count < 1:
        raise ValueError(f"a context needs at least 1 I/O thread, not {count}")
    if _started_io is not None:
        return _started_io
    default_context().set(zmq.IO_THREADS, count)
    return count


def _configure(sock: zmq.Socket, max_message_bytes: int | None, timeout_s: float, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    if max_message_bytes is not None:  # enforced by the tcp decoder; inproc passes messages as they are
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))


_BASE = zmq.Socket.__mro__[1]
"""pyzmq's compiled socket under its Python one: send, recv and poll called on it directly skip
the Python wrappers (per part: an isinstance, an enum's `|`, a method; a Poller per
Socket.poll), about 4 us a message each way on a 2-core machine, several times that on a
core that has just slept in a poll."""
_SNDMORE, _NOBLOCK, _POLLIN = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.POLLIN)
_send, _recv = _BASE.send, _BASE.recv


def _send_parts(sock: zmq.Socket, frames: Sequence[Any]) -> None:
    """Send frames as one message, without a copy above pyzmq's copy threshold."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _send(sock, f, _SNDMORE if i < last else 0, False)


def _receive(sock: zmq.Socket, heads: int, flags: int = 0) -> list:
    """The parts of the next message: its first `heads` parts (identity, header: small) as
    bytes, which costs less than a zmq.Frame and its view; the rest (tensors) as views on
    frames, without a copy. zmq.Again where flags has NOBLOCK and nothing is there."""
    frame = _recv(sock, flags, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, 0, False)
        parts.append(frame.bytes if len(parts) < heads else frame.buffer)
    return parts


# -- socket monitors: why a handshake failed ---------------------------------------------------

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket | None:
    """A PAIR socket receiving sock's events, or None (monitoring is only diagnostics)."""
    try:
        return sock.get_monitor_socket(events)
    except zmq.ZMQError as e:
        log.debug("no socket monitor: %s", e)
        return None


def _unmonitor(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(0)


def _events(monitor: zmq.Socket | None) -> list[tuple[int, int]]:
    """(event, value) of every event waiting on monitor, without blocking."""
    out = []
    while monitor is not None and monitor.poll(0):
        msg = parse_monitor_message(monitor.recv_multipart())
        out.append((int(msg["event"]), int(msg["value"])))
    return out


def _handshake_text(event: int, value: int, server: bool, curve: bool = True) -> str:
    """Why a handshake failed, from the server's or the client's side (curve: whether this
    client speaks CURVE)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the authenticator refused the client's CURVE public key (ZAP status {value}): it is not "
                f"among the allowed client keys" if server else
                f"the server refused this client's CURVE key (ZAP status {value}): its public key is not in "
                f"the server's allowed/ folder")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return ("security mechanism mismatch: one side uses CURVE and the other does not "
                "(give both the same key directory)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return ("CURVE handshake could not be decrypted: the client holds another server's public key"
                if server else "CURVE handshake failed (cryptographic error)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"handshake protocol error 0x{value:08x}"
    if server:
        return f"handshake failed without detail (errno {value})"
    if not curve:
        return (f"handshake failed without detail (errno {value}); this worker uses no CURVE: if "
                "the server was started with --curve, give the worker the same key directory")
    return (f"handshake failed without detail (errno {value}); with CURVE this is what a wrong "
            "server public key looks like, or a server started without --curve")


# -- one ZAP authenticator per context ---------------------------------------------------------

_auth_lock = threading.Lock()
_authenticators: dict[int, list] = {}  # id(context) -> [context, ThreadAuthenticator, users]


def _acquire_authenticator(context: zmq.Context, allowed_dir: str) -> str:
    """Start (or share) the context's authenticator, let it check allowed_dir's keys under a
    ZAP domain of their own (read now: a key added later needs a new transport); the domain."""
    from zmq.auth.thread import ThreadAuthenticator

    domain = "psar-" + hashlib.sha256(allowed_dir.encode()).hexdigest()[:16]
    with _auth_lock:
        entry = _authenticators.get(id(context))
        if entry is None:
            auth = ThreadAuthenticator(context, log=logging.getLogger("psar.ps.auth"))
            auth.start()
            entry = _authenticators[id(context)] = [context, auth, 0]
        entry[1].configure_curve(domain=domain, location=allowed_dir)
        entry[2] += 1
    return domain


def _release_authenticator(context: zmq.Context) -> None:
    with _auth_lock:
        entry = _authenticators.get(id(context))
        if entry is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                del _authenticators[id(context)]
                entry[1].stop()


def _need_curve() -> None:
    if not zmq.has("curve"):
        raise TransportError(f"CURVE was asked for, but this libzmq {zmq.zmq_version()} was built without it")


class ServerTransport:
    """ROUTER socket of one server shard.

    Args:
        bind: endpoint, e.g. "tcp://127.0.0.1:5555", "tcp://127.0.0.1:*" (ephemeral port;
            see .address) or "inproc://shard0".
        max_message_bytes: inbound message parts above this are refused by the socket.
        send_timeout_s: a reply that cannot be queued within this is dropped and logged.
        context: zmq context (share it for inproc://); default the process-wide one.
        curve: ServerKeys (ps.security.load_server_keys) to require CurveZMQ: only clients
            whose public key is in curve.allowed_dir get through the handshake. None: no
            security (loopback and trusted networks only).

    .events counts what the socket monitor saw (read by the serving thread in recv):
    "handshakes" completed, "refused" handshakes, "disconnects" (including connections the
    socket dropped for a message part above max_message_bytes).
    """

    def __init__(self, bind: str, max_message_bytes: int | None = None, send_timeout_s: float = 60.0,
                 context: Any = None, hwm: int = DEFAULT_HWM, curve: ServerKeys | None = None):
        self._context = _context_for(context)
        self._curve = curve
        self._sock = self._context.socket(zmq.ROUTER)
        _configure(self._sock, max_message_bytes, send_timeout_s, hwm)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        self._sock.copy_threshold = REPLY_COPY_BYTES
        authenticated = False
        try:
            if curve is not None:
                _need_curve()
                self._sock.curve_secretkey = curve.secret
                self._sock.curve_publickey = curve.public
                self._sock.curve_server = True
                domain = _acquire_authenticator(self._context, curve.allowed_dir)
                authenticated = True
                self._sock.zap_domain = domain.encode()
                try:  # no authenticator answering: refuse rather than let everyone in
                    self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                except (zmq.ZMQError, AttributeError):
                    pass
            self._sock.bind(bind)
        except (zmq.ZMQError, TransportError) as e:
            self._sock.close(0)
            if authenticated:
                _release_authenticator(self._context)
            raise TransportError(f"cannot bind {bind}{' with CURVE' if curve else ''}: {e}") from e
        self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.events = {"handshakes": 0, "refused": 0, "disconnects": 0}
        self._throttle = Throttle(log)  # refused handshakes (a client retrying), failed replies
        self._monitor = _monitor(self._sock, _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                 | zmq.EVENT_DISCONNECTED)
        self._polled = [(self._sock, _POLLIN)] + ([(self._monitor, _POLLIN)] if self._monitor is not None else [])
        # inproc passes the parts themselves: a peer's frames would be the shard's own memory,
        # writable, so there only what pyzmq lends is lent
        self._sender = _sends.Sender(self._sock.underlying, self._sock, REPLY_COPY_BYTES
                                     if self.address.startswith("inproc://") else SEND_COPY_BYTES) \
            if compiled_on() and linked(_sends) else None
        if curve is not None:
            log.info("%s: CURVE on; clients allowed by the public keys in %s", self.address, curve.allowed_dir)

    def recv(self, timeout_s: float) -> tuple[bytes, list[memoryview]] | None:
        """(peer identity, frames) of the next message, or None if none came within timeout_s."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            ready = zmq.zmq_poll(self._polled, max(0, int((deadline - time.monotonic()) * 1000)))
            if len(ready) > 1 or ready and ready[0][0] is self._monitor:
                self._note_events()
            if ready and ready[0][0] is self._sock:
                identity, *frames = _receive(self._sock, heads=2)
                if self._sender is not None:  # the parts ZeroMQ has sent are let go before the shard reads a key
                    self._sender.sweep()
                return identity, frames
            if time.monotonic() >= deadline:
                return None

    def _note_events(self) -> None:
        for event, value in _events(self._monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.events["handshakes"] += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.events["disconnects"] += 1
            elif event & _HANDSHAKE_FAILED:
                self.events["refused"] += 1
                why = _handshake_text(event, value, server=True)
                self._throttle.log(logging.WARNING, why, "%s: refused a client at the handshake: %s",
                                   self.address, why)

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        """Send to peer; False (and a log line) if the peer is gone or its queue stays full."""
        try:
            if self._sender is None:
                _send_parts(self._sock, [peer, *frames])
                return True
            err = self._sender.send([peer, *frames])
            if not err:
                return True
            raise zmq.Again() if err == zmq.EAGAIN else zmq.ZMQError(err)
        except (zmq.Again, zmq.ZMQError) as e:  # a peer gone: one line per kind and interval
            self._throttle.log(logging.WARNING, ("send", type(e), getattr(e, "errno", None)),
                               "%s: could not send %d frame(s) to peer %r: %s", self.address, len(frames), peer, e)
            return False

    def close(self) -> None:
        if self._sock.closed:
            return
        if self._sender is not None:  # libzmq frees the socket: a later send must not reach it
            self._sender.close()
        _unmonitor(self._sock, self._monitor)
        self._sock.close(LINGER_MS)
        if self._curve is not None:
            _release_authenticator(self._context)


class ClientTransport:
    """DEALER socket of a worker towards one server shard.

    Args:
        connect: the shard's endpoint.
        max_message_bytes, context, hwm: as for ServerTransport.
        send_timeout_s: a send that cannot be queued within this raises TransportError.
        curve: ClientKeys (ps.security.load_client_keys) to speak CurveZMQ to a server with
            that public key; None: no security. Must match the server's choice, or nothing
            gets through (see handshake_error).
    """

    def __init__(self, connect: str, max_message_bytes: int | None = None, send_timeout_s: float = 60.0,
                 context: Any = None, hwm: int = DEFAULT_HWM, curve: ClientKeys | None = None):
        self.address = connect
        self._sock = _context_for(context).socket(zmq.DEALER)
        _configure(self._sock, max_message_bytes, send_timeout_s, hwm)
        self._handshake_error: str | None = None
        self._drained = float("-inf")  # when the monitor was last read
        self._curve = curve is not None
        self._monitor = None
        try:
            if curve is not None:
                _need_curve()
                self._sock.curve_secretkey = curve.secret
                self._sock.curve_publickey = curve.public
                self._sock.curve_serverkey = curve.server_public
            self._monitor = _monitor(self._sock, _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._sock.connect(connect)
        except (zmq.ZMQError, TransportError) as e:
            _unmonitor(self._sock, self._monitor)
            self._sock.close(0)
            raise TransportError(f"cannot connect to {connect}{' with CURVE' if curve else ''}: {e}") from e

    def send(self, frames: Sequence[Any]) -> None:
        now = time.monotonic()
        if now - self._drained >= MONITOR_DRAIN_S:  # libzmq blocks on a full monitor
            self._drained = now
            self.handshake_error()
        try:
            _send_parts(self._sock, frames)
        except zmq.ZMQError as e:
            raise self.send_failed(e.errno) from e

    def send_failed(self, errno: int) -> TransportError:
        """What to raise where a send to this shard failed with ZeroMQ's errno (EAGAIN: the queue
        stayed full, where a refused handshake leaves no connection to queue on)."""
        if errno == zmq.EAGAIN:
            why = self.handshake_error()
            if why:
                return HandshakeRefused(f"could not send to {self.address}: the handshake failed: {why}")
            return TransportError(f"could not send to {self.address}: its queue stayed full")
        return TransportError(f"could not send to {self.address}: {zmq.strerror(errno)}")

    def recv_ready(self) -> list[memoryview] | None:
        """Frames of a message already here, None if none is (never waits)."""
        try:
            return _receive(self._sock, 1, _NOBLOCK)
        except zmq.Again:
            return None

    def readable(self, timeout_s: float = 0.0) -> bool:
        return bool(zmq.zmq_poll([(self._sock, _POLLIN)], max(0, int(timeout_s * 1000))))

    def recv(self, timeout_s: float, what: str = "a reply") -> list[memoryview]:
        """Frames of the next message; PeerTimeout naming the address if none within timeout_s."""
        if not self.readable(timeout_s):
            raise PeerTimeout(f"no message from {self.address} within {timeout_s:g} s while waiting for {what}")
        return _receive(self._sock, 1)

    def handshake_error(self) -> str | None:
        """Why the last handshake with the server failed, None if it succeeded (or none was
        tried yet). Call from the thread that uses this transport."""
        for event, value in _events(self._monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_error = None
            elif event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or self._handshake_error is None:
                # A retry that fails without detail says less than the failure before it.
                self._handshake_error = _handshake_text(event, value, server=False, curve=self._curve)
        return self._handshake_error

    def close(self) -> None:
        if self._sock.closed:
            return
        _unmonitor(self._sock, self._monitor)
        self._sock.close(LINGER_MS)

    @property
    def socket(self) -> zmq.Socket:
        return self._sock


class PollSet:
    """One poller over a fixed list of client transports (a worker's shards), made once."""

    def __init__(self, transports: Sequence[ClientTransport]) -> None:
        self._polled = [(t.socket, _POLLIN) for t in transports]
        self._index = {t.socket: i for i, t in enumerate(transports)}

    def poll(self, timeout_s: float) -> list[int]:
        """Indexes of the transports with a message waiting, after at most timeout_s."""
        return [self._index[s] for s, _ in zmq.zmq_poll(self._polled, max(0, int(timeout_s * 1000)))]
