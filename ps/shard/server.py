"""One server shard: the parameters of its keys, the experiment's optimizer, one handler per op.

ShardServer.handle(peer, frames) is the whole protocol and touches no socket, so it is
tested directly; serve(transport) is the loop around it (ps.shard.dispatch). The shard asks
its consistency rule (ps.shard.consistency: sync, async, ssp) when a push updates and when a
pull is answered.

A worker that has done all its steps sends leave; a pull with wait_left waits until every
other worker has left (or is lost), which is how the final parameters are read. The serve
loop ends by itself once every worker has left or is lost (ps.shard.workers).

Row-sparse keys (embedding tables, see ps.layout) are held as (rows, dim) and may be pushed
and pulled by rows (ps.shard.rows): the optimizer updates only the pushed rows and their
state; a pull by rows gets copies of just those rows.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ps.codec import Codec, GradientPulls
from ps.config import PSConfig
from ps.layout import TORCH_DTYPES, Layout
from ps.protocol import REQUESTS, Limits, Message, encode, pack_header, pull_of
from ps.protocol_short import WholeKeys
from ps.shard.consistency import rule_for
from ps.shard.dispatch import Dispatcher, Reply, serve
from ps.shard.fastpath import PushPullPath
from ps.shard.optim import ShardOptimizer
from ps.shard.reject import Reject
from ps.shard.settings import SettingsCheck
from ps.shard.snapshots import SnapshotPool
from ps.shard.state import ShardState
from ps.shard.waiting import Waiting
from ps.shard.workers import Workers

log = logging.getLogger("psar.ps.server")


class ShardServer(ShardState):
    """Server shard `shard` of `layout`.

    Args:
        shard: index of this shard in the layout.
        layout: the agreed layout; this shard holds layout.shard_keys(shard).
        values: {key id: initial values} for exactly this shard's keys (copied).
        make_optimizer: builds the experiment's optimizer over a list of tensors (called once
            per key, with that key's chunk).
        mode: "sync", "async" or "ssp" (ps.protocol.MODES).
        num_workers: workers 0..num_workers-1 take part.
        config: PSConfig (timeouts, staleness bound, loss policy, async scaling).
        clock: time source, injectable for tests (default time.monotonic).
        trace: optional callable(name, start, end, thread=...) given every optimizer update.
        reply_delay_s: every reply leaves this much later (an injected slow link); the loop
            goes on serving meanwhile.
        checkpoint_every, save: save(state_dict()) each time the version reaches a multiple
            of checkpoint_every (sync: steps; async/ssp: worker-steps, so every x num_workers).
        settings: {name: scalar} this shard runs with and every worker must share; a join
            whose settings differ is refused, naming each. A setting the shard does not have
            (one only workers use) must equal the first joined worker's. None: not checked.
        compressor: compress.method's compressor (experiments.compression, by shape), whose
            pushes this shard decompresses (ps.codec); None: pushes come whole.
        compress_pulls: under sync, pulls carry each update's compressed gradient, which the
            workers apply themselves (ps.codec.GradientPulls), instead of the values.
    """

    def __init__(self, shard: int, layout: Layout, values: dict[int, torch.Tensor],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], mode: str,
                 num_workers: int, config: PSConfig = PSConfig(), clock: Callable[[], float] = time.monotonic,
                 trace: Callable[..., None] | None = None, reply_delay_s: float = 0.0,
                 checkpoint_every: int = 0, save: Callable[[dict], None] | None = None,
                 settings: dict[str, Any] | None = None, compressor: Any = None, compress_pulls: bool = False):
        rule = rule_for(mode)
        if not 0 <= shard < layout.num_shards:
            raise ValueError(f"shard {shard} out of range for a layout of {layout.num_shards} shards")
        if type(num_workers) is not int or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.shard, self.layout, self.num_workers = shard, layout, num_workers
        self.config, self.clock = config, clock
        self.trace, self.reply_delay_s = trace, reply_delay_s
        self.save = save
        self.keys = [k.id for k in layout.shard_keys(shard)]
        if set(values) != set(self.keys):
            raise ValueError(f"shard {shard}: values given for keys {sorted(values)}, expected {self.keys}")
        self.chunks: dict[int, torch.Tensor] = {}  # flat, or (rows, dim) for a row-sparse key
        for kid in self.keys:
            key, t = layout.keys[kid], values[kid]
            dtype = TORCH_DTYPES[layout.dtype(key)]
            if t.numel() != key.numel or t.dtype != dtype:
                raise ValueError(f"shard {shard}: key {kid} needs {key.numel} {dtype} values, got {t.numel()} {t.dtype}")
            dim = layout.row_dim(key)
            shape = (key.numel // dim, dim) if dim else (key.numel,)
            self.chunks[kid] = t.detach().reshape(shape).clone()  # a leaf tensor owned by the server
        self.sparse_keys = frozenset(k for k, c in self.chunks.items() if c.dim() == 2)  # held by rows
        self.version = 0
        self.workers = Workers(num_workers, len(self.keys))
        self.counters = dict(updates=0, pushes=0, pulls=0, joins=0, bytes_in=0, bytes_out=0, malformed=0, rejected=0,
                             rows_pushed=0, rows_pulled=0, row_collisions=0, codec_us=0,
                             dropped_keys=0, moved_keys=0)
        self.rule = rule(self)
        self.mode = self.rule.name
        self.checkpoint_every = checkpoint_every * self.rule.versions_per_step
        # An update of a few keys costs what those keys cost, in one optimizer call.
        self.optimizer = ShardOptimizer(make_optimizer, self.chunks)
        self.snapshots = SnapshotPool(self.chunks, TORCH_DTYPES[config.wire_dtype] if config.wire_dtype else None)
        self.codec = Codec(compressor, layout) if compressor is not None else None
        if compress_pulls and (self.codec is None or self.mode != "sync"):
            raise ValueError("compressed pulls need a compressor and sync: under async and ssp each worker "
                             "reads other versions, not one update's gradient")
        self.pulls = GradientPulls(self.codec) if compress_pulls else None
        self.settings = SettingsCheck(shard, settings)
        self.waiting = Waiting()
        self._dispatch = Dispatcher(shard, layout, self.workers, config.wire_dtype, self.codec,
                                    Limits(max_tensor_bytes=config.max_message_bytes),
                                    {op: getattr(self, f"_on_{op}") for op in REQUESTS}, self._release,
                                    self.counters, clock)
        dense = [k for k, c in self.chunks.items() if c.dim() == 1 and c.device.type == "cpu"]
        self.whole_keys = WholeKeys(layout, dense, self._dispatch.limits)
        """The whole dense keys of this shard, as a reply or push+pull of them carries each (its
        dtype's name, shape and bytes): what the short paths read and write."""
        self._started = clock()
        self.aborted: str | None = None
        self.stopped = False
        self.staleness: dict[int, int] = {}
        self.max_clock_gap = 0
        self._short = PushPullPath(self)

    @property
    def finished(self) -> bool:
        """Every worker has left or is lost: nothing more will come."""
        return self.workers.finished

    # -- the handler -------------------------------------------------------------------------

    def handle(self, peer: bytes, frames: Sequence[Any]) -> list[Reply]:
        """Handle one request; return the replies to send (possibly to other, waiting peers).
        A push+pull of whole keys takes the short path where it can (ps.shard.fastpath)."""
        replies = self._short(peer, frames)
        return replies if replies is not None else self._dispatch.handle(peer, frames, self.aborted)

    def tick(self) -> list[Reply]:
        """Periodic work: declare silent workers lost, answer pulls now ready or out of time."""
        now, config = self.clock(), self.config
        if not self.aborted and now - self._started > config.timeout_s:
            for w in self.workers.never_joined():
                self._lose(w, f"worker {w} did not join within timeout_s={config.timeout_s:g} s")
        for w, quiet in self.workers.silent_for(now):
            if not self.aborted and w not in self.workers.lost and quiet > config.worker_timeout_s:
                self._lose(w, f"worker {w} silent for {quiet:.2f} s (worker_timeout_s={config.worker_timeout_s:g})")
        replies = self._release()
        for d in self.waiting.expired(now):
            replies.append(self._dispatch.error(d.peer, d.msg.worker, d.msg.req,
                                                f"shard {self.shard}: {d.msg.op} waited {now - d.since:.2f} s "
                                                f"(timeout_s={self.config.timeout_s:g}) for {self._waits_for(d.msg)}"))
        if self.aborted:
            replies += [self._dispatch.error(d.peer, d.msg.worker, d.msg.req, self.aborted)
                        for d in self.waiting.take_all()]
        return replies

    def serve(self, transport: Any, stop_event: threading.Event | None = None,
              report: tuple[float, Callable[[dict], None]] | None = None) -> str:
        """The loop around handle and tick on transport (see ps.shard.dispatch.serve)."""
        return serve(self, transport, stop_event, report)

    # -- ops -----------------------------------------------------------------------------------

    def _on_join(self, peer: bytes, msg: Message) -> list[Reply]:
        """Register the worker and send it the layout and values; a rejoin (a new process in
        a lost or dead one's place) is answered when its rule counts it in."""
        w = msg.worker
        if w in self.workers.left:
            raise Reject(f"worker {w} has already left this run")
        self.settings.check(w, msg.get("settings"))
        self.workers.joined.add(w)
        self.counters["joins"] += 1
        if msg.get("rejoin"):
            self.workers.rejoin(w)
            log.info("shard %d: worker %d rejoined at version %d", self.shard, w, self.version)
            if not self.rule.rejoin(w):
                self.waiting.add(peer, msg, self.clock(), self.config.timeout_s, {})
                return []
        reply = self._join_reply(peer, msg)  # the values as they are, before anything it lets go on
        self.rule.joined(w)
        return [reply]

    def _join_reply(self, peer: bytes, msg: Message) -> Reply:
        body = {"layout": self.layout.to_wire(), "shard": self.shard, "mode": self.mode,
                "num_workers": self.num_workers, "fingerprint": self.layout.fingerprint,
                "clock": self.workers.clocks[msg.worker]}
        return self._values(peer, msg, self.keys, exact=True, body=body)

    def _on_init(self, peer: bytes, msg: Message) -> list[Reply]:
        raise Reject("this shard already has its model; init is sent once, by worker 0, before any join")

    def _on_leave(self, peer: bytes, msg: Message) -> list[Reply]:
        self.workers.leave(msg.worker)
        log.info("shard %d: worker %d left", self.shard, msg.worker)
        self.rule.worker_gone()
        return [self._ok(peer, msg)]

    def _on_heartbeat(self, peer: bytes, msg: Message) -> list[Reply]:
        return [self._ok(peer, msg)]

    def _on_stats(self, peer: bytes, msg: Message) -> list[Reply]:
        return [self._ok(peer, msg, body=self.stats())]

    def _on_checkpoint(self, peer: bytes, msg: Message) -> list[Reply]:
        return [self._values(peer, msg, self.keys, exact=True)]

    def _on_shutdown(self, peer: bytes, msg: Message) -> list[Reply]:
        self.stopped = True
        log.info("shard %d: shutdown requested by worker %d", self.shard, msg.worker)
        return [self._ok(peer, msg)]

    def _on_pull(self, peer: bytes, msg: Message, **fields: Any) -> list[Reply]:
        """Answer now if the pull's condition holds, else once it does (fields: more of the
        reply's header, a push+pull's staleness). A pull with a clip scale first makes the
        held step's update."""
        if msg.get("scale") is not None:
            self.rule.scale(msg)
        self.counters["pulls"] += 1
        return self._answer_or_wait(peer, msg, fields)

    def _on_norm(self, peer: bytes, msg: Message) -> list[Reply]:
        """The sum of squares of held step `step`'s averaged gradient on this shard, once every
        key of it is in."""
        self.rule.check_norm()
        return self._answer_or_wait(peer, msg, {})

    def _on_wait(self, peer: bytes, msg: Message) -> list[Reply]:
        """Answer, without values, once this shard's version reaches min_version (the whole
        step done, not only some keys); else once it does."""
        return self._answer_or_wait(peer, msg, {})

    def _on_push(self, peer: bytes, msg: Message) -> list[Reply]:
        h = msg.header
        w, step, version, keys = h["worker"], h["step"], h["version"], msg.keys
        self.check_push(w, step, version, keys, msg)
        if msg.parts:  # compressed: rebuilt whole (contents checked) before anything is applied
            start = time.perf_counter()
            try:
                msg.tensors[:] = [self.codec.decompress(k, p, m) for k, p, m in zip(keys, msg.parts, h["meta"])]
            except ValueError as e:
                raise Reject(f"push of step {step}: {e}") from e
            self.counters["codec_us"] += int(1e6 * (time.perf_counter() - start))
        elif self.codec is not None:
            raise Reject(f"this run compresses pushes (compress.method={self.codec.name}); worker {w} "
                         "pushed whole values")
        # validated: from here on the push is applied
        if self.config.wire_dtype:  # compressed on the wire: back to the master values' dtype
            msg.tensors[:] = [g.to(self.chunks[k].dtype) for k, g in zip(keys, msg.tensors)]
        stale = self.take_push(w, step, version, keys, msg.tensors, msg.ids, h.get("lr"), bool(h.get("hold")))
        if h.get("pull"):  # the pushed keys' values, under the push's own conditions
            return self._on_pull(peer, pull_of(h), staleness=stale)
        return [self._ok(peer, msg, staleness=stale, version=self.version)]

    def check_push(self, w: int, step: int, version: int, keys: list[int], msg: Message) -> None:
        """Refuse (Reject) a push of keys by worker w for step, computed on version, that this
        shard cannot take now (msg: its 'hold' and 'lr', for the rule). Pushes taken the short
        way (ps.shard.fastpath) are asked the same."""
        if not keys:
            raise Reject("push names no keys")
        if version > self.version:
            raise Reject(f"push says its gradient was computed on version {version}, "
                         f"but this shard is only at version {self.version}")
        if step < self.workers.clocks[w]:
            raise Reject(f"worker {w} already pushed all keys of step {step} (its clock is {self.workers.clocks[w]})")
        self.rule.check_step(w, step)
        done = self.workers.pushed(w, step)
        if done and not done.isdisjoint(keys):
            raise Reject(f"worker {w} pushed key(s) {[k for k in keys if k in done]} of step {step} twice")
        self.rule.check_push(w, step, msg)

    def take_push(self, w: int, step: int, version: int, keys: list[int], grads: list[torch.Tensor],
                  ids: list, lr: float | None, hold: bool) -> int:
        """Apply a checked push (check_push): its staleness counted, then the rule's push of
        grads (ids: per key its row ids or None; [] for whole keys). Its staleness."""
        stale = self.version - version
        self.staleness[stale] = self.staleness.get(stale, 0) + 1
        counters = self.counters
        counters["pushes"] += 1
        if ids:
            counters["rows_pushed"] += sum(i.numel() for i in ids if i is not None)
        self.rule.push(w, step, keys, grads, ids or [None] * len(keys), lr, hold)
        return stale

    # -- requests that wait ----------------------------------------------------------------------

    def _answer_or_wait(self, peer: bytes, msg: Message, fields: dict) -> list[Reply]:
        if self._ready(msg):
            return [self._answer(peer, msg, **fields)]
        self.waiting.add(peer, msg, self.clock(), self.config.timeout_s, fields)
        return []

    def _answer(self, peer: bytes, msg: Message, **fields: Any) -> Reply:
        """The reply to a pull (its values), a wait (the version) or a norm whose condition holds."""
        if msg.op == "wait":
            return self._ok(peer, msg, version=self.version, **fields)
        if msg.op == "join":
            return self._join_reply(peer, msg)
        if msg.op == "norm":
            return self._ok(peer, msg, version=self.version, sq=self.rule.norm_of(msg.get("step")), **fields)
        self._note_gap(msg)
        return self._values(peer, msg, msg.keys or self.keys, exact=bool(msg.get("wait_left")), **fields)

    def _ready(self, msg: Message) -> bool:
        if msg.op == "wait":
            return self.version >= msg.get("min_version")
        if msg.op == "join":
            return msg.worker not in self.workers.joining
        if msg.op == "norm":
            return self.rule.norm_ready(msg.get("step"))
        return self.pull_ready(msg)

    def pull_ready(self, msg: Message) -> bool:
        """Whether a pull's condition holds: wait_left, min_version and the rule's own."""
        if msg.get("wait_left") and any(w != msg.worker for w in self.workers.live()):
            return False
        min_version = msg.get("min_version")
        if min_version is not None and self.rule.version_of(msg.keys or self.keys) < min_version \
                and not self.rule.over():
            return False
        return self.rule.pull_ready(msg)

    def _waits_for(self, msg: Message) -> str:
        parts = []
        if msg.op == "norm":
            parts.append(self.rule.norm_waits_for(msg.get("step")))
        if msg.op == "join":
            parts.append(f"step {self.version} to finish, to count rejoined worker {msg.worker} in from the next")
        if msg.get("min_version") is not None:
            parts.append(f"version >= {msg.get('min_version')} (shard at version {self.version})")
        rule_reason = self.rule.pull_waits_for(msg)
        if rule_reason:
            parts.append(rule_reason)
        if msg.get("wait_left"):
            others = sorted(w for w in self.workers.live() if w != msg.worker)
            parts.append(f"workers {others} to leave")
        return " and ".join(parts) or "nothing"

    def _release(self, keys: set[int] | None = None) -> list[Reply]:
        """Answer the waiting requests whose condition now holds (keys: only these keys were
        updated since the last look, none if empty: Rule.readied, Waiting.ready)."""
        if self.aborted or not self.waiting or keys is not None and not keys:
            return []
        return [self._answer(d.peer, d.msg, waited_us=int(waited * 1e6), **d.fields)
                for d, waited in self.waiting.ready(self._ready, self.clock(), keys)]

    def _lose(self, w: int, reason: str) -> None:
        self.workers.lose(w, reason)
        if self.config.loss_policy(self.mode) == "abort":
            self.aborted = f"shard {self.shard} aborted: {reason}"
            log.error("%s", self.aborted)
            return
        log.warning("shard %d: dropping %s; continuing with workers %s", self.shard, reason,
                    sorted(self.workers.live()))
        self.rule.worker_gone()

    # -- replies -------------------------------------------------------------------------------

    def _ok(self, peer: bytes, msg: Message, **fields: Any) -> Reply:
        return self._dispatch.send(peer, encode({"op": "ok", "worker": msg.worker, "req": msg.req, **fields}))

    def _note_gap(self, msg: Message) -> None:
        """How far ahead of the slowest live worker a pull lets its worker run (any mode)."""
        clock = msg.get("clock")
        slowest = self.workers.slowest() if clock is not None else None
        if slowest is not None:
            self.max_clock_gap = max(self.max_clock_gap, clock - slowest[1])

    def whole_values(self, header: dict, keys: list[int]) -> list | None:
        """A reply of whole keys' current values: header's fields, each key's dtype and shape
        (what encode would add for the chunk's flat values: the same bytes), and the chunks'
        own bytes (SnapshotPool.reply_bytes), without encode's look at each tensor; None where
        a key is not whole and dense here. The replies of pulls that waited (a sync step's first
        pushes, ssp's), written as the short path writes its own (ps.shard.fastpath)."""
        table = self.whole_keys.table
        entries = [table.get(k) for k in keys]
        if None in entries:
            return None
        header["dtypes"] = [e[0] for e in entries]
        header["shapes"] = [e[1] for e in entries]
        return [pack_header(header), *map(self.snapshots.reply_bytes, keys)]

    def _values(self, peer: bytes, msg: Message, keys: list[int], exact: bool = False, **fields: Any) -> Reply:
        """The values of keys, in the wire dtype under compression unless exact (join, the
        final pull, checkpoint: what the worker keeps must be the master values); of the rows
        a pull names, for a pull by rows."""
        header = {"op": "ok", "worker": msg.worker, "req": msg.req, "version": self.rule.version_of(keys),
                  "keys": list(keys), **fields}
        pull = msg.op == "pull"
        if pull:
            self.rule.read(msg.worker)
        if self.pulls is not None and not exact and pull:  # the update's compressed gradient
            parts = [self.pulls.message(k, self.rule.version_of([k])) for k in keys]
            return self._dispatch.send(peer, encode(header, parts=[(p.frames, p.meta) for p in parts]))
        if pull and not msg.ids and (exact or self.snapshots.wire is None):
            frames = self.whole_values(header, keys)
            if frames is not None:
                return self._dispatch.send(peer, frames)
        if not pull or not msg.ids:
            return self._dispatch.send(peer, encode(header, [self.snapshots.snapshot(k, exact) for k in keys]))
        wire = self.snapshots.wire if not exact else None
        tensors = []
        for k, i in zip(keys, msg.ids):
            if i is None:
                tensors.append(self.snapshots.snapshot(k, exact))
            else:  # index_select copies: the reply never points into the chunk
                rows = self.chunks[k].detach().index_select(0, i)
                tensors.append(rows.to(wire) if wire is not None else rows)
                self.counters["rows_pulled"] += i.numel()
        return self._dispatch.send(peer, encode(header, tensors, msg.ids))

    # -- state ---------------------------------------------------------------------------------

    def apply(self, keys: Sequence[int], label: Callable[[], str] | str, count: bool = True,
              lr: float | None = None, *, grads: Sequence[torch.Tensor], divisors: list[int] | None = None) -> None:
        """One optimizer step over the chunks of `keys` with grads, one a key, each shaped as
        its chunk, at learning rate lr (None: the optimizer's). count: it is an update of the
        shard (the counter). label: the trace's name for it, or a function giving it (called
        only with a trace: a push's update does not format its name). divisors: each gradient
        is divided by its own first (a sync step's sum of pushes becomes their mean); what the
        gradients hold after the call is undefined (divided in place, or not).
        SGD's replay (ps.shard.optim.sgd_step) takes the grads as they are, and the divisors
        into its pass over each key; other steps read them as the chunks' .grad, set here and
        cleared after (which cost a 1 KiB key's update 14 of its 73 us on a core that had
        just slept)."""
        start = time.time() if self.trace is not None else 0.0
        dense = self.sparse_keys.isdisjoint(keys)
        if divisors is not None and not (dense and self.optimizer.replays and self.pulls is None):
            grads = [g.div_(d) if d != 1 else g for g, d in zip(grads, divisors)]
            divisors = None
        if self.pulls is not None:  # the update applies what its pull will carry
            began = time.perf_counter()
            grads = [self.pulls.compress(k, g.reshape(-1), self.version + 1).view_as(self.chunks[k])
                     for k, g in zip(keys, grads)]
            self.counters["codec_us"] += int(1e6 * (time.perf_counter() - began))
        for k in keys:
            if self.snapshots.own(k):  # a reply still pointed at it: copied first
                self.counters["moved_keys"] += 1
        if dense and self.optimizer.replays:
            self.optimizer.step(keys, lr, grads, divisors)
        else:
            for k, g in zip(keys, grads):
                self.chunks[k].grad = g
            if dense:
                self.optimizer.step(keys, lr)
            else:
                # Row gradients are built from validated ids (ps.shard.rows), so torch's own checks of
                # sparse tensors are off here; saying so keeps the optimizers from warning that they are.
                with torch.sparse.check_sparse_tensor_invariants(enable=False):
                    self.optimizer.step(keys, lr)
            for k in keys:
                self.chunks[k].grad = None
        for k in keys:
            self.snapshots.updated(k)
        self.counters["updates"] += int(count)
        if self.trace is not None:
            self.trace(label() if callable(label) else label, start, time.time(), thread=f"shard {self.shard}",
                       version=self.version)

    def use_cores(self, threads: int) -> int:
        """Update on `threads` cores: on threads of the optimizer's own where its step is
        elementwise (SGD, Adam, AdamW, Adagrad: ps.shard.slices), with torch on one thread of
        this process, else on torch's intra-op threads. Call it once, from the process the shard serves in (it sets
        torch's threads for the whole process); the threads torch runs on."""
        torch.set_num_threads(1 if self.optimizer.take_threads(threads) else threads)
        return torch.get_num_threads()

    def bump(self) -> None:
        self.version += 1
        if self.save is not None and self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self.save(self.state_dict())

    def stats(self) -> dict[str, Any]:
        """Counters as a plain dict (str keys, msgpack-able)."""
        workers = self.workers
        return {
            "shard": self.shard, "mode": self.mode, "version": self.version, **self.counters,
            "staleness": {str(s): n for s, n in sorted(self.staleness.items())},
            "queue_wait": dict(self.waiting.waits), "deferred": len(self.waiting),
            "joined_workers": sorted(workers.joined), "live_workers": sorted(workers.live()),
            "left_workers": sorted(workers.left), "rejoined_workers": sorted(workers.rejoined),
            "lost_workers": {str(w): why for w, why in workers.lost.items()},
            "clocks": {str(w): c for w, c in workers.clocks.items()}, "aborted": self.aborted,
            "max_clock_gap": self.max_clock_gap,
            "dropped": {str(s): sorted(ws) for s, ws in sorted(self.rule.dropped.items())},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # of the process
            "memory": self.memory(),
        }
