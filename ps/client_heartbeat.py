"""A PSClient's heartbeats: a thread of its own, with its own sockets, tells every shard once
a heartbeat interval that this worker lives and learns from the answers which shards are
alive and which restarted and forgot it; a wait that goes on asks it. A mixin of
ps.client.PSClient, whose fields it reads: addresses, worker, heartbeat_s, joins, _limits,
_hb_thread, _hb_stop, _hb_tick, last_heard, forgotten, heartbeat_error, _joins_lock."""

from __future__ import annotations

import threading
import time

from ps.flight import PSError
from ps.protocol import ProtocolError, decode, encode
from ps.transport import PeerTimeout, TransportError


class Heartbeats:
    def _check_heartbeats(self, h: Handle) -> None:
        """A shard that stopped answering heartbeats is gone: say so without waiting timeout_s
        (a reply held back on purpose still comes with heartbeats answered meanwhile)."""
        if self._hb_thread is None or self._hb_stop.is_set():
            return
        silence_s = max(3 * self.heartbeat_s, 2.0)
        now = time.monotonic()
        if now - self._hb_tick > silence_s:  # the heartbeats did not run (this process stopped): nothing known
            return
        pending = sorted(set(h.pending.values()))
        # Any shard, not only those this wait is for: a reply from another shard may be held
        # back until the other workers take their next step, which needs that shard rejoined.
        restarted = sorted(self.forgotten) if h.kind != "join" else []
        if restarted:
            where = ", ".join(f"{self.addresses[s]} (shard {s})" for s in restarted)
            raise PSError(f"worker {self.worker}: {where} restarted and no longer knows this worker; "
                          f"{h.kind} (req {sorted(h.pending)}) cannot go on until it joins again")
        gone = [s for s in pending if now - self.last_heard.get(s, now) > silence_s]
        if gone:
            where = ", ".join(f"{self.addresses[s]} (shard {s})" for s in gone)
            raise PeerTimeout(f"worker {self.worker}: {where} stopped answering heartbeats "
                              f"{silence_s:g} s ago, with {h.kind} (req {sorted(h.pending)}) unanswered")

    def _start_heartbeat(self) -> None:
        if self._hb_thread is None:
            self.last_heard = {s: time.monotonic() for s in range(len(self.addresses))}
            self._hb_tick = time.monotonic()
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"ps-heartbeat-{self.worker}",
                                               daemon=True)
            self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        transports = [self._transport(a, send_timeout_s=self.heartbeat_s) for a in self.addresses]
        try:
            while not self._hb_stop.wait(self.heartbeat_s):
                now = time.monotonic()
                if now - self._hb_tick > 2 * self.heartbeat_s + 1.0:
                    # This process was stopped (SIGSTOP, a preempted VM): the shards' silence
                    # meanwhile is ours; they get a fresh interval to answer.
                    self.last_heard = {s: now for s in self.last_heard}
                self._hb_tick = now
                joins = self.joins
                header = encode({"op": "heartbeat", "worker": self.worker, "req": joins})
                for s, t in enumerate(transports):
                    while t.readable(0):  # replies: proof of life; errors are kept
                        self.last_heard[s] = time.monotonic()
                        try:
                            msg = decode(t.recv(0), None, None, self._limits)
                        except ProtocolError as e:
                            msg = None
                            self.heartbeat_error = f"{t.address}: malformed heartbeat reply: {e}"
                        if msg is not None and msg.op == "error":
                            self.heartbeat_error = f"{t.address}: {msg.get('error')}"
                            # It restarted and forgot us; an answer to a heartbeat sent
                            # before our last join says nothing about that join.
                            with self._joins_lock:
                                if msg.get("code") == "not_joined" and msg.req >= self.joins:
                                    self.forgotten.add(s)
                    try:
                        t.send(header)
                    except TransportError as e:
                        self.heartbeat_error = str(e)
        finally:
            for t in transports:
                t.close()
