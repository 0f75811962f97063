"""A shard's short path for the message it gets most: a push+pull of whole dense keys.

The engines send one a bucket (sync: asking for the next version, `min_version`; async and
ssp: under a `clock`), and `psar bench` times one against a ZeroMQ round trip. The general
path (ps.protocol.decode, then ps.shard.dispatch, then the push and pull handlers) costs
about 165 Python and C calls for one key; on a core that has just slept in a poll each call
costs several times what it costs in a loop (a 1 KiB push+pull took 62 us in a loop and
150-175 us between messages), so the count of calls is the cost.

This path takes a message only when every check the general one makes holds for it, in
fewer calls: the header's fields are exactly a push+pull's, each key of this shard is
checked against a table built once (dtype name, shape, bytes), the worker has joined and is
not lost, the push is of the step and version the rule takes, no key twice, nothing held for
a clip, no compression. Anything else, every malformed or refused message among it, goes
the general way, which names the problem; so this path never has an error of its own. What
the push does is still the rule's (ps.shard.consistency): the same state, replies and
counters bit for bit (tests/unit/test_shard_fastpath.py runs both on the same messages).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from ps.protocol_schema import PROTOCOL_VERSION, Message
from ps.protocol_short import WholeKeys, ints

_REQUIRED = frozenset(("v", "op", "worker", "req", "step", "version", "keys", "dtypes", "shapes", "pull"))
_ALLOWED = _REQUIRED | {"min_version", "clock", "lr"}


class PushPullPath:
    """The short path of `server` (a ps.shard.ShardServer); __call__(peer, frames) -> its
    replies, or None where the message must go the general way."""

    def __init__(self, server: Any) -> None:
        self.server = server
        dense = [k for k, c in server.chunks.items() if c.dim() == 1 and c.device.type == "cpu"]
        self._whole = WholeKeys(server.layout, dense, server._dispatch.limits)

    def __call__(self, peer: bytes, frames: list) -> list | None:
        s = self.server
        if s.aborted or s.codec is not None or s.pulls is not None or s.config.wire_dtype:
            return None
        h = self._whole.header(frames)
        if h is None or not _REQUIRED <= h.keys() <= _ALLOWED or h["op"] != "push" or h["pull"] != 1 \
                or h["v"] != PROTOCOL_VERSION:
            return None
        w, req, step, version, lr = h["worker"], h["req"], h["step"], h["version"], h.get("lr")
        if not ints(h["v"], h["pull"], w, req, step, version, h.get("min_version"), h.get("clock")) \
                or lr is not None and (type(lr) is not float or not 0.0 <= lr < float("inf")):
            return None
        workers, rule = s.workers, s.rule
        if w not in workers.seen or w in workers.lost or version > s.version or step < workers.clocks[w]:
            return None
        keys, grads = h["keys"], self._whole.tensors(h, frames)
        if grads is None or not rule.takes(w, step, lr):
            return None
        done = workers.pushed(w, step)
        if done and not done.isdisjoint(keys):
            return None
        # Every check of the general path holds: from here on the push is applied.
        try:
            return self._apply(peer, h, keys, grads, frames)
        except Exception as e:  # as the general path: an error reply, never a dead shard
            return [s._dispatch.failed(peer, w, req, "push", e)]

    def _apply(self, peer: bytes, h: dict, keys: list[int], grads: list[torch.Tensor], frames: list) -> list:
        s, rule, workers = self.server, self.server.rule, self.server.workers
        w, req, step, version = h["worker"], h["req"], h["step"], h["version"]
        mv, clock, lr = h.get("min_version"), h.get("clock"), h.get("lr")
        counters = s.counters
        counters["bytes_in"] += len(frames[0]) + sum(view.nbytes for view in frames[1:])
        workers.seen[w] = s.clock()
        stale = s.version - version
        s.staleness[stale] = s.staleness.get(stale, 0) + 1
        counters["pushes"] += 1
        rule.push(w, step, keys, grads, [None] * len(keys), lr, False)
        counters["pulls"] += 1
        pull = {"op": "pull", "v": h["v"], "worker": w, "req": req, "keys": keys}
        if mv is not None:
            pull["min_version"] = mv
        if clock is not None:
            pull["clock"] = clock
        msg = Message(pull)
        others = s._release(rule.readied) if rule.may_release else []  # sync: a push that made keys ready
        if mv is not None and rule.version_of(keys) < mv and not rule.over() or not rule.pull_ready(msg):
            s.waiting.add(peer, msg, s.clock(), s.config.timeout_s, {"staleness": stale})
            return others
        if clock is not None:
            s._note_gap(msg)
        header = {"v": PROTOCOL_VERSION, "op": "ok", "worker": w, "req": req, "version": rule.version_of(keys),
                  "keys": list(keys), "staleness": stale, "dtypes": h["dtypes"], "shapes": h["shapes"]}
        rule.read(w)
        out = [msgpack.packb(header, use_bin_type=True)]
        chunks = s.chunks
        for k in keys:
            t = chunks[k].detach()  # a view of its own: the reply counts as a use (ps.shard.snapshots)
            out.append(memoryview((t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()).cast("B"))
        counters["bytes_out"] += len(out[0]) + sum(f.nbytes for f in out[1:])
        return [(peer, out), *others]
