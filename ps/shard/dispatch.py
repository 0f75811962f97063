"""A shard's front door: every message is validated, then handed to the handler of its op;
whatever goes wrong becomes an error reply. serve() is the loop around it on a transport.

The dispatcher touches no socket, so a shard is tested by calling it directly.
"""

from __future__ import annotations

import heapq
import logging
import threading
from typing import Any, Callable, Sequence

from ps.protocol import REPLIES, Limits, Message, ProtocolError, decode, error_reply, peek_ids
from ps.shard.reject import Reject
from ps.throttle import Throttle

log = logging.getLogger("psar.ps.server")
Reply = tuple[bytes, list]


def nbytes(frames: Sequence[Any]) -> int:
    try:
        return sum(memoryview(f).nbytes for f in frames)
    except TypeError:
        return 0


TICK_S = 0.005
"""A busy shard's periodic work (liveness, deadlines) runs at most this often, not after every
message: it scans every worker and every waiting request."""


class Dispatcher:
    """Requests to shard `shard` of layout, from workers 0..num_workers-1 (`workers`, whose
    `seen` and `lost` it reads and stamps), go to handlers {op: fn(peer, msg) -> replies}.

    A request is answered by its handler only if it decodes against the layout (op known,
    keys, dtypes, shapes, sizes: ps.protocol), is a request, comes from a worker that is not
    lost and has joined (or is joining); after it, then(): replies it made possible (pulls
    that waited). counters: "bytes_in", "bytes_out", "malformed", "rejected" are counted here."""

    def __init__(self, shard: int, layout: Any, workers: Any, wire: str | None, codec: Any, limits: Limits,
                 handlers: dict[str, Callable[[bytes, Message], list[Reply]]], then: Callable[[], list[Reply]],
                 counters: dict[str, int], clock: Callable[[], float]) -> None:
        self.shard, self.layout, self.workers, self.wire, self.limits = shard, layout, workers, wire, limits
        self.codec = codec
        self.handlers, self.then, self.counters, self.clock = handlers, then, counters, clock
        self._throttle = Throttle(log, clock=clock)  # a hostile peer must not flood the log

    def handle(self, peer: bytes, frames: Sequence[Any], aborted: str | None) -> list[Reply]:
        """The replies to one request; after an abort, its reason as the error."""
        self.counters["bytes_in"] += nbytes(frames)
        if aborted:
            return [self.error(peer, *peek_ids(frames), aborted)]
        try:
            msg = decode(frames, self.layout, self.workers.ids, self.limits, shard=self.shard, wire=self.wire,
                         codec=self.codec)
        except Exception as e:  # ProtocolError; anything else is a decoder bug, still not fatal
            text = str(e) if isinstance(e, ProtocolError) else f"undecodable message: {type(e).__name__}: {e}"
            self.counters["malformed"] += 1
            self._throttle.log(logging.WARNING, "malformed", "shard %d: malformed message from peer %r: %s (%d so far)",
                               self.shard, peer, text, self.counters["malformed"])
            return [self.error(peer, *peek_ids(frames), f"shard {self.shard}: {text}")]
        try:
            w = msg.worker
            if msg.op in REPLIES:
                raise Reject(f"expected a request, got a {msg.op!r} message")
            if w in self.workers.lost and not (msg.op == "join" and msg.get("rejoin")):
                raise Reject(f"worker {w} was declared lost: {self.workers.lost[w]}")
            if msg.op != "join" and w not in self.workers.seen:
                raise Reject(f"worker {w} has not joined; send join first", code="not_joined")
            self.workers.seen[w] = self.clock()
            replies = self.handlers[msg.op](peer, msg)
        except Exception as e:
            return [self.failed(peer, msg.worker, msg.req, msg.op, e)]
        return replies + self.then()

    def failed(self, peer: bytes, worker: int, req: int, op: str, e: Exception) -> Reply:
        """The error reply to a valid request that its handler refused (Reject) or failed on
        (a bug or an optimizer failure must not take the shard down silently)."""
        self.counters["rejected"] += 1
        if isinstance(e, Reject):
            self._throttle.log(logging.INFO, ("rejected", op, e.code), "shard %d: rejected %s from worker %d: %s",
                               self.shard, op, worker, e)
            return self.error(peer, worker, req, f"shard {self.shard}: {e}", e.code)
        log.exception("shard %d: internal error on %s from worker %d", self.shard, op, worker)
        return self.error(peer, worker, req, f"shard {self.shard}: internal error: {type(e).__name__}: {e}")

    def send(self, peer: bytes, frames: list) -> Reply:
        self.counters["bytes_out"] += nbytes(frames)
        return peer, frames

    def error(self, peer: bytes, worker: int, req: int, text: str, code: str | None = None) -> Reply:
        return self.send(peer, error_reply(worker, req, text, code))


def serve(server: Any, transport: Any, stop_event: threading.Event | None = None,
          report: tuple[float, Callable[[dict], None]] | None = None) -> str:
    """Receive, server.handle, server.tick and reply until every worker has left ("finished"),
    shutdown, abort or stop_event; returns why it ended. report=(period_s, fn): fn(stats())
    every period_s and once at the end, from this loop's thread (so the counters are never
    read mid-update). Replies leave server.reply_delay_s late (an injected slow link), while
    the loop goes on serving.

    After an abort it goes on answering errors for a short grace period (so that waiting
    workers learn why), then ends.
    """
    config, clock = server.config, server.clock
    poll_s = min(0.1, config.heartbeat_s / 2, config.worker_timeout_s / 4)
    grace_s = min(config.timeout_s, max(0.5, 2 * config.heartbeat_s))
    abort_at = None
    held: list[tuple[float, int, bytes, list]] = []  # replies waiting out reply_delay_s
    sequence = 0
    next_report = clock() + report[0] if report else float("inf")
    next_tick = float("-inf")
    try:
        while not (stop_event is not None and stop_event.is_set()):
            if clock() >= next_report:
                report[1](server.stats())
                next_report += report[0]
            wait_s = poll_s if not held else max(0.0, min(poll_s, held[0][0] - clock()))
            item = transport.recv(wait_s)
            replies = server.handle(*item) if item is not None else []
            now = clock()
            if item is None or now >= next_tick:  # handle already answered what its request let go on
                replies += server.tick()
                next_tick = now + TICK_S
            if server.reply_delay_s or held:
                for peer, frames in replies:
                    sequence += 1
                    heapq.heappush(held, (now + server.reply_delay_s, sequence, peer, frames))
                while held and held[0][0] <= now:
                    _, _, peer, frames = heapq.heappop(held)
                    transport.send(peer, frames)
            else:
                for peer, frames in replies:
                    transport.send(peer, frames)
            replies = frames = item = None  # sent: nothing here keeps a reply's snapshot in use
            if held:
                continue
            if server.stopped:
                return "shutdown"
            if server.finished and not server.aborted and not server.waiting:
                return "finished"
            if server.aborted:
                abort_at = abort_at if abort_at is not None else clock() + grace_s
                if clock() >= abort_at:
                    return server.aborted
        return "stopped"
    finally:
        if report:
            report[1](server.stats())
