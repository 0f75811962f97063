"""The "Van": sockets and framing, and the only module of ps/ that imports zmq.

Server shard: a ROUTER bound to one address. Worker: one DEALER per server shard. Frames go
out and come in with copy=False, so tensor bytes are not copied in Python; the caller must
not modify a sent tensor until the matching reply has arrived.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import zmq

log = logging.getLogger("psar.ps.transport")

DEFAULT_HWM = 1000
"""Messages queued per peer before a send blocks (then times out): bounded memory, and a
push of a few hundred keys never waits on it."""
LINGER_MS = 100


class PeerTimeout(TimeoutError):
    """No message from a peer within the timeout; the text names the address and the wait."""


class TransportError(RuntimeError):
    """A send that could not be completed; the text names the address."""


def default_context() -> zmq.Context:
    """The process-wide context: inproc:// endpoints only connect within one context."""
    return zmq.Context.instance()


def _configure(sock: zmq.Socket, max_message_bytes: int | None, timeout_s: float, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    if max_message_bytes is not None:  # enforced by the tcp decoder; inproc passes messages as they are
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))


def _views(frames: Sequence[zmq.Frame]) -> list[memoryview]:
    return [f.buffer for f in frames]


class ServerTransport:
    """ROUTER socket of one server shard.

    Args:
        bind: endpoint, e.g. "tcp://127.0.0.1:5555", "tcp://127.0.0.1:*" (ephemeral port;
            see .address) or "inproc://shard0".
        max_message_bytes: inbound message parts above this are refused by the socket.
        send_timeout_s: a reply that cannot be queued within this is dropped and logged.
        context: zmq context (share it for inproc://); default the process-wide one.
    """

    def __init__(self, bind: str, max_message_bytes: int | None = None, send_timeout_s: float = 60.0,
                 context: Any = None, hwm: int = DEFAULT_HWM):
        self._sock = (context or default_context()).socket(zmq.ROUTER)
        _configure(self._sock, max_message_bytes, send_timeout_s, hwm)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise TransportError(f"cannot bind {bind}: {e}") from e
        self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[bytes, list[memoryview]] | None:
        """(peer identity, frames) of the next message, or None if none came within timeout_s."""
        if not self._poller.poll(max(0, int(timeout_s * 1000))):
            return None
        identity, *frames = self._sock.recv_multipart(copy=False)
        return identity.bytes, _views(frames)

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        """Send to peer; False (and a log line) if the peer is gone or its queue stays full."""
        try:
            self._sock.send_multipart([peer, *frames], copy=False)
            return True
        except (zmq.Again, zmq.ZMQError) as e:
            log.warning("%s: could not send %d frame(s) to peer %r: %s", self.address, len(frames), peer, e)
            return False

    def close(self) -> None:
        self._sock.close(LINGER_MS)


class ClientTransport:
    """DEALER socket of a worker towards one server shard.

    Args:
        connect: the shard's endpoint.
        max_message_bytes, context, hwm: as for ServerTransport.
        send_timeout_s: a send that cannot be queued within this raises TransportError.
    """

    def __init__(self, connect: str, max_message_bytes: int | None = None, send_timeout_s: float = 60.0,
                 context: Any = None, hwm: int = DEFAULT_HWM):
        self.address = connect
        self._sock = (context or default_context()).socket(zmq.DEALER)
        _configure(self._sock, max_message_bytes, send_timeout_s, hwm)
        try:
            self._sock.connect(connect)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise TransportError(f"cannot connect to {connect}: {e}") from e

    def send(self, frames: Sequence[Any]) -> None:
        try:
            self._sock.send_multipart(list(frames), copy=False)
        except zmq.Again as e:
            raise TransportError(f"could not send to {self.address}: its queue stayed full") from e
        except zmq.ZMQError as e:
            raise TransportError(f"could not send to {self.address}: {e}") from e

    def readable(self, timeout_s: float = 0.0) -> bool:
        return bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def recv(self, timeout_s: float, what: str = "a reply") -> list[memoryview]:
        """Frames of the next message; PeerTimeout naming the address if none within timeout_s."""
        if not self.readable(timeout_s):
            raise PeerTimeout(f"no message from {self.address} within {timeout_s:g} s while waiting for {what}")
        return _views(self._sock.recv_multipart(copy=False))

    def close(self) -> None:
        self._sock.close(LINGER_MS)

    @property
    def socket(self) -> zmq.Socket:
        return self._sock


def poll_many(transports: Sequence[ClientTransport], timeout_s: float) -> list[ClientTransport]:
    """The transports with a message waiting, after at most timeout_s."""
    poller = zmq.Poller()
    for t in transports:
        poller.register(t.socket, zmq.POLLIN)
    ready = dict(poller.poll(max(0, int(timeout_s * 1000))))
    return [t for t in transports if t.socket in ready]
