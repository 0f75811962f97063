"""How a PSClient's requests are answered: a wait polls every shard's socket at once and
files each reply with the request it answers (by request id), whatever shard it comes from;
it ends at the deadline naming the silent shards, or sooner where the heartbeats say a shard
is gone, and sends what the window holds when nothing comes. A mixin of ps.client.PSClient,
whose fields it reads: addresses, worker, layout, codec, _pollset, _transports, _inflight,
_held, _limits, _wire, _hb_thread, heartbeat_s, heartbeat_error, bytes_recv."""

from __future__ import annotations

import logging
import time

from ps.flight import Handle, PSError
from ps.protocol import Message, ProtocolError, decode
from ps.protocol_short import decode_reply
from ps.transport import PeerTimeout

log = logging.getLogger("psar.ps.client")

UNBLOCK_S = 0.5
"""With push+pulls held by the window, a wait that hears nothing for this long sends the next
ones anyway (see PushWindow._unblock)."""


class Replies:
    def _wait_replies(self, h: Handle, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waited = False
        while not h.done:
            if waited:  # what heartbeats learn ends a wait that goes on, not one answered at once
                self._check_heartbeats(h)
            waited = True
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(h.pending.values()))
                where = ", ".join(f"{self.addresses[s]} (shard {s})" for s in missing)
                hint = f"; last heartbeat error: {self.heartbeat_error}" if self.heartbeat_error else ""
                for s in missing:  # a refused handshake is the likeliest cause of a silent shard
                    why = self._transports[s].handshake_error()
                    hint += f"; handshake with {self.addresses[s]} failed: {why}" if why else ""
                raise PeerTimeout(f"worker {self.worker}: no reply from {where} within {timeout_s:g} s "
                                  f"to {h.kind} (req {sorted(h.pending)}){hint}")
            # Wake at least every heartbeat interval: what the heartbeats learn (a shard gone
            # silent, or restarted) must end this wait, not the timeout.
            wait_s = min(left, self.heartbeat_s) if self._hb_thread is not None else left
            if any(self._held.values()):
                wait_s = min(wait_s, UNBLOCK_S)
                if not self._progress(wait_s):
                    self._unblock()
            else:
                self._progress(wait_s)
        h.keep.clear()
        if h.error is not None:
            raise h.error

    def abandon(self) -> None:
        """Forget every request in flight (after a shard restarted, their replies never come)."""
        for h in self._inflight.values():
            h.pending.clear()
        self._inflight.clear()
        self._held.clear()
        self._unanswered.clear()
        self._counted.clear()

    def _progress(self, timeout_s: float, drain: bool = False) -> int:
        """Wait at most timeout_s for replies from the shards; file one from each shard that
        has one (drain: every reply already here); how many came. Late replies of requests
        no longer awaited are filed (and dropped) too."""
        came = 0
        if self._lane is not None:  # (ps.client_compiled) one message a call, read there if it can
            took = self._lane.take(max(0, int(timeout_s * 1000)))
            while took is not None:
                self._file(*took)
                came += 1
                took = self._lane.take(0) if drain else None
            return came
        ready = self._pollset.poll(timeout_s)
        while ready:
            for s in ready:
                frames = self._transports[s].recv_ready()
                if frames is not None:
                    self._file(s, frames)
                    came += 1
            # A wait polls again while its handle is pending; a failed non-blocking receive
            # costs 4x a poll, so more replies are looked for by polling.
            ready = self._pollset.poll(0) if drain else ()
        return came

    def _file(self, s: int, frames: list | Message, nbytes: int | None = None) -> None:
        """File a reply from shard s: its frames, or the Message the compiled lane read (of
        nbytes)."""
        if type(frames) is Message:
            self.bytes_recv += nbytes
            msg = frames
        else:
            self.bytes_recv += sum(map(len, frames))  # bytes, or byte views (ps.transport)
            msg = decode_reply(frames, self._whole[s]) if self._whole else None
        try:
            msg = msg or decode(frames, self.layout, None, self._limits, shard=s, wire=self._wire, codec=self.codec)
        except ProtocolError as e:
            raise PSError(f"malformed reply from {self.addresses[s]} (shard {s}): {e}") from e
        h = self._inflight.pop(msg.req, None)
        self._release(msg.req)
        if h is None:
            if msg.op == "error" and msg.req == -1:  # the server could not even read our request id
                raise PSError(f"{self.addresses[s]} (shard {s}) refused a message: {msg.get('error')}")
            log.debug("worker %d: late reply %d from shard %d ignored", self.worker, msg.req, s)
            return
        h.pending.pop(msg.req, None)
        h.done_at = time.time()
        if msg.op == "error":
            h.error = PSError(f"{self.addresses[s]} (shard {s}) refused {h.kind} (req {msg.req}): {msg.get('error')}",
                              msg.get("code"))
            for req in h.pending:  # the handle has failed: its other replies are not awaited
                self._inflight.pop(req, None)
            self._drop_held(h.pending)  # and what the window still holds of it is not sent
            h.pending.clear()
        else:
            h.replies[s] = msg
