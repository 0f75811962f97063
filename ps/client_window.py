"""A PSClient's window of push+pulls per shard (ps.window_mb): what the shard has not answered
yet, and the messages held on the worker until it does, which leave by priority (lowest
first, then the earliest request). A mixin of ps.client.PSClient, whose fields it reads:
_held, _unanswered, _counted, _window, _transports, bytes_sent."""

from __future__ import annotations

import heapq

LANE_HEADER_BYTES = 256
"""The most bytes a push's header has besides its keys' entries (msgpack: every field the
compiled lane writes, each integer at its widest: 179)."""
LANE_KEY_BYTES = 48
"""The most bytes a key adds to that header: its id (9), its dtype's name (16 at most, 5 of
string header) and its shape (whole keys leave flat: one dimension, 9, and 5 of array header)."""


class PushWindow:
    """Each push+pull is answered once every worker has pushed its keys, so a worker whose
    flow to a shard runs ahead of the others' fills its window and waits, leaving that
    shard's link to the workers behind (whose pieces the shard needs before it can answer
    anyone). Without it, one shard and 2 workers on 200mbit: 2.19 s a step; with 3 MiB,
    2.11 s (4 workers: 4.79 s, 4.45 s; the ideal 1.95 s and 3.90 s)."""

    def _push_pull(self, s: int, req: int, frames: list, nbytes: int, priority: int | None) -> None:
        """Send push+pull req to shard s, or hold it while the window is full or holds others
        (they leave by priority, then request: see PSClient.push)."""
        if self._window and (self._held[s] or not self._fits(s, nbytes)):
            heapq.heappush(self._held[s], (req if priority is None else priority, req, frames, nbytes))
        else:
            self._send(s, req, frames, nbytes, counted=True)

    def _window_open(self, grads) -> bool:
        """Whether the window would send a push+pull of whole keys grads to each of its shards at
        once (nothing held there, and room for the keys' bytes and the largest header a message
        of them can have: LANE_HEADER_BYTES, and LANE_KEY_BYTES a key): then the compiled lane may
        send it (ps.client_compiled), and _count_sent counts what it sent. Else the Python path
        decides, message by message."""
        key_shard, key_nbytes = self.layout.key_shard, self.layout.key_nbytes
        n_keys = len(key_shard)
        need: dict[int, int] = {}
        for k in grads:
            if type(k) is not int or not 0 <= k < n_keys:
                return False  # (the Python path names the key)
            s = key_shard[k]
            need[s] = need.get(s, LANE_HEADER_BYTES) + key_nbytes[k] + LANE_KEY_BYTES
        for s, nbytes in need.items():  # as _push_pull decides
            if self._held[s] or not self._fits(s, nbytes):
                return False
        return True

    def _count_sent(self, pending: dict[int, int], sizes: dict[int, int]) -> None:
        """Count push+pulls the compiled lane sent ({req: shard}, {req: bytes}) in the window,
        as _send counts the Python path's."""
        for req, s in pending.items():
            nbytes = sizes[req]
            self._unanswered[s] += nbytes
            self._counted[req] = (s, nbytes)

    def _drop_held(self, reqs) -> None:
        """What the window still holds of requests reqs is never sent (their handle failed)."""
        for s, held in self._held.items():
            self._held[s] = [m for m in held if m[1] not in reqs]
            heapq.heapify(self._held[s])

    @property
    def queued_bytes(self) -> int:
        """Bytes of the push+pulls the window still holds on this client (not in bytes_sent)."""
        return sum(m[3] for held in self._held.values() for m in held)

    def _fits(self, s: int, nbytes: int) -> bool:
        return not self._unanswered[s] or self._unanswered[s] + nbytes <= self._window

    def _send(self, s: int, req: int, frames: list, nbytes: int, counted: bool = False) -> None:
        self._transports[s].send(frames)
        self.bytes_sent += nbytes
        if counted and self._window:
            self._unanswered[s] += nbytes
            self._counted[req] = (s, nbytes)

    def _release(self, req: int) -> None:
        """req was answered (or abandoned): send what the window now lets through."""
        s, nbytes = self._counted.pop(req, (None, 0))
        if s is None:
            return
        self._unanswered[s] -= nbytes
        held = self._held[s]
        while held and self._fits(s, held[0][3]):
            self._send(s, *heapq.heappop(held)[1:], counted=True)

    def _unblock(self) -> None:
        """Nothing came for a while with messages held: send each shard's next one anyway, so
        that workers whose keys leave in different orders can never wait on each other."""
        for s, held in self._held.items():
            if held:
                self._send(s, *heapq.heappop(held)[1:], counted=True)
