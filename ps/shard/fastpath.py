"""A shard's short path for the message it gets most: a push+pull of whole dense keys (the
compiled one, ps.shard.compiled, first where it is built).

The engines send one a bucket (sync: asking for the next version, `min_version`; async and
ssp: under a `clock`), and `psar bench` times one against a ZeroMQ round trip. The general
path (ps.protocol.decode, then ps.shard.dispatch, then the push and pull handlers) costs
about 165 Python and C calls for one key; on a core that has just slept in a poll each call
costs several times what it costs in a loop (a 1 KiB push+pull took 62 us in a loop and
150-175 us between messages), so the count of calls is the cost.

This path takes a message only when every check the general one makes holds for it, in
fewer calls: the header's fields are exactly a push+pull's, each key of this shard is
checked against a table built once (dtype name, shape, bytes; ps.protocol_short), the worker
has joined and is not lost, no compression, and the shard's own checks of a push pass
(ShardServer.check_push). Anything else, every malformed or refused message among it, goes
the general way, which names the problem; so this path never has an error of its own. The
push is taken and its pull's condition asked as the general path does (take_push,
pull_ready); what it leaves out is the general decoder, the dispatcher's Message and the
general reply's look at every tensor, whose frames it takes from views of the chunks kept
from one reply to the next (SnapshotPool.reply_bytes): the same state, replies and counters
bit for bit (tests/unit/test_shard_fastpath.py runs both on the same messages).
"""

from __future__ import annotations

from typing import Any

import torch

from ps.protocol import pack_header, pull_of
from ps.protocol_schema import PROTOCOL_VERSION, Message
from ps.protocol_short import ints
from ps.shard.compiled import compiled_path
from ps.shard.reject import Reject

_REQUIRED = frozenset(("v", "op", "worker", "req", "step", "version", "keys", "dtypes", "shapes", "pull"))
_ALLOWED = _REQUIRED | {"min_version", "clock", "lr"}


class PushPullPath:
    """The short path of `server` (a ps.shard.ShardServer); __call__(peer, frames) -> its
    replies, or None where the message must go the general way."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._whole = server.whole_keys
        self._wire = server.config.wire_dtype  # the config is fixed for the shard's life
        self.compiled = compiled_path(server, self._whole.table, self._wait)  # None: this shard's are Python's

    def __call__(self, peer: bytes, frames: list) -> list | None:
        if self.compiled is not None:
            replies = self.compiled(peer, frames)
            if replies is not None:
                return replies
        return self._python(peer, frames)

    def _wait(self, peer: bytes, frames: list, stale: int) -> None:
        """The compiled path's sync push+pull whose pull waits, its push taken: the pull waits
        as _apply has it wait."""
        s = self.server
        s.waiting.add(peer, pull_of(self._whole.header(frames)), s.clock(), s.config.timeout_s, {"staleness": stale})

    def _python(self, peer: bytes, frames: list) -> list | None:
        s = self.server
        if s.aborted or s.codec is not None or s.pulls is not None or self._wire:
            return None
        h = self._whole.header(frames)
        if h is None or not _REQUIRED <= h.keys() <= _ALLOWED or h["op"] != "push" or h["pull"] != 1 \
                or h["v"] != PROTOCOL_VERSION:
            return None
        w, req, step, version, lr = h["worker"], h["req"], h["step"], h["version"], h.get("lr")
        if None in (w, req, step, version) \
                or not ints(h["v"], h["pull"], w, req, step, version, h.get("min_version"), h.get("clock")) \
                or lr is not None and (type(lr) is not float or not 0.0 <= lr < float("inf")):
            return None
        workers, keys, grads = s.workers, h["keys"], self._whole.tensors(h, frames)
        if grads is None or w not in workers.seen or w in workers.lost:  # the dispatcher's checks
            return None
        try:
            s.check_push(w, step, version, keys, Message(h))
        except Reject:  # the general path says why
            return None
        # Every check of the general path holds: from here on the push is applied.
        try:
            return self._apply(peer, h, w, req, step, version, lr, keys, grads, frames)
        except Exception as e:  # as the general path: an error reply, never a dead shard
            return [s._dispatch.failed(peer, w, req, "push", e)]

    def _apply(self, peer: bytes, h: dict, w: int, req: int, step: int, version: int, lr: float | None,
               keys: list[int], grads: list[torch.Tensor], frames: list) -> list:
        """The general path's push, then its pull (ps.shard.server), in fewer calls."""
        s, rule = self.server, self.server.rule
        s.counters["bytes_in"] += sum(map(len, frames))  # bytes and byte views (WholeKeys.tensors)
        s.workers.seen[w] = s.clock()
        stale = s.take_push(w, step, version, keys, grads, [], lr, False)
        s.counters["pulls"] += 1
        msg = pull_of(h)
        others = s._release(rule.readied)  # sync: only pulls of the keys the push made ready
        if not s.pull_ready(msg):
            s.waiting.add(peer, msg, s.clock(), s.config.timeout_s, {"staleness": stale})
            return others
        if "clock" in h:
            s._note_gap(msg)
        header = {"op": "ok", "worker": w, "req": req, "version": rule.version_of(keys), "keys": list(keys),
                  "staleness": stale, "dtypes": h["dtypes"], "shapes": h["shapes"]}
        rule.read(w)
        out = [pack_header(header), *map(s.snapshots.reply_bytes, keys)]
        s.counters["bytes_out"] += sum(map(len, out))
        return [(peer, out), *others]
