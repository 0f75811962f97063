"""One server shard: the parameters of its keys, the experiment's optimizer, one handler.

ShardServer.handle(peer, frames) is the whole protocol and touches no socket, so it is
tested directly; serve(transport) is the loop around it. Modes:

- sync (BSP): gradients of a step are summed per key; as soon as every live worker has
  pushed a key, its grad is the mean over the workers that pushed it and the optimizer
  updates that key, and a pull waiting for it is answered at once, while other keys are
  still arriving (pushes and pulls share the link's two directions). When every key is
  updated the step is complete and the version goes up by one. The keys that become ready
  together (a bucket's) are updated in one optimizer call (ps.shard_optim); each key's update
  is what one optimizer step over all of them does to it (the optimizers here are per tensor).
- async (Hogwild-style): every push is applied on arrival (grad scaled by 1/N under
  async_scale="mean"); the version counts completed worker-steps on this shard.
- ssp: async, and a pull with clock c waits until c - (slowest live worker's clock) <= s.

A worker that has done all its steps sends leave; a pull with wait_left waits until every
other worker has left (or is lost), which is how the final parameters are read. The serve
loop ends by itself once every worker has left or is lost. A worker that has not joined
within timeout_s of the shard's start is lost.

A worker's clock on a shard is 1 + the last step whose keys it has all pushed there.

Row-sparse keys (embedding tables, see ps.layout) are held as (rows, dim) and may be pushed
and pulled by rows: a push's rows become a sparse gradient (duplicates over workers summed
under sync), so the optimizer updates only those rows and their state; a pull by rows gets
copies of just those rows. Under async and ssp a shard counts row collisions: rows of a push
that another worker's push changed after this worker read them (Hogwild!'s conflicts).
"""

from __future__ import annotations

import heapq
import logging
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ps.config import PSConfig
from ps.layout import TORCH_DTYPES, Layout
from ps.protocol import REPLIES, Limits, Message, ProtocolError, decode, encode, error_reply, peek_ids
from ps.shard_optim import ShardOptimizer

log = logging.getLogger("psar.ps.server")
# Row gradients are built from validated ids (ps.protocol), so torch's own checks of sparse
# tensors are off; saying so explicitly keeps the optimizers from warning that they are.
torch.sparse.check_sparse_tensor_invariants.disable()

MODES = ("sync", "async", "ssp")
PARTIAL_STEPS = 64
"""Incomplete steps remembered per worker (async/ssp); older ones are forgotten."""
Reply = tuple[bytes, list]
SPARE_SNAPSHOTS = 4
"""Former buffers kept per key for reuse (snapshots in the wire dtype, and a chunk's former
memory while replies still point at it): on a slow link ZeroMQ still holds the replies of a
few updates back, and a fresh allocation of a large buffer costs its page faults on every
update (a shard's push+pull of 1 MiB took 590 us in a profile with one spare, 440 us with
kept buffers)."""


def _nbytes(frames: Sequence[Any]) -> int:
    try:
        return sum(memoryview(f).nbytes for f in frames)
    except TypeError:
        return 0


def _in_use(t: torch.Tensor) -> bool:
    """Whether anything besides `t` holds its memory: a reply built on it (frames that ZeroMQ
    has not sent yet, or a reader's tensors). A fresh allocation of a large snapshot costs
    page faults on every update (a 16 MiB clone took 2x a copy into a kept buffer); a kept
    buffer is written again only when nothing else can see it. Without torch's use count,
    every buffer counts as in use (a fresh copy each time)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is None or count(t.untyped_storage()._cdata) > 2  # t's own, and this call's


class _Reject(Exception):
    """A well-formed request that cannot be served now; becomes an error reply (with `code`
    where a client acts on the kind)."""

    def __init__(self, text: str, code: str | None = None) -> None:
        super().__init__(text)
        self.code = code


@dataclass
class _Deferred:
    peer: bytes
    msg: Message
    since: float
    deadline: float
    fields: dict = field(default_factory=dict)  # more of the reply's header


class ShardServer:
    """Server shard `shard` of `layout`.

    Args:
        shard: index of this shard in the layout.
        layout: the agreed layout; this shard holds layout.shard_keys(shard).
        values: {key id: initial values} for exactly this shard's keys (copied).
        make_optimizer: builds the experiment's optimizer over a list of tensors (called once
            per key, with that key's chunk).
        mode: "sync", "async" or "ssp".
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
    """

    def __init__(self, shard: int, layout: Layout, values: dict[int, torch.Tensor],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], mode: str,
                 num_workers: int, config: PSConfig = PSConfig(), clock: Callable[[], float] = time.monotonic,
                 trace: Callable[..., None] | None = None, reply_delay_s: float = 0.0,
                 checkpoint_every: int = 0, save: Callable[[dict], None] | None = None,
                 settings: dict[str, Any] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= shard < layout.num_shards:
            raise ValueError(f"shard {shard} out of range for a layout of {layout.num_shards} shards")
        if type(num_workers) is not int or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.shard, self.layout, self.mode, self.num_workers = shard, layout, mode, num_workers
        self.config, self.clock = config, clock
        self.trace, self.reply_delay_s = trace, reply_delay_s
        self.save = save
        self.settings = settings
        self._first_settings: tuple[int, dict[str, Any]] | None = None  # (worker, its settings)
        self.checkpoint_every = checkpoint_every * (1 if mode == "sync" else num_workers)
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
        # async/ssp, row-sparse keys: who last changed each row, and by which update (counter)
        self._row_writer = {k: torch.full((c.shape[0],), -1, dtype=torch.int32)
                            for k, c in self.chunks.items() if c.dim() == 2 and mode != "sync"}
        self._row_update = {k: torch.zeros(len(w), dtype=torch.int64) for k, w in self._row_writer.items()}
        self._read_at: dict[int, int] = {}  # worker -> the update counter when its last pull was answered
        # An update of a few keys costs what those keys cost, in one optimizer call.
        self.optimizer = ShardOptimizer(make_optimizer, self.chunks)
        self._limits = Limits(max_tensor_bytes=config.max_message_bytes)
        self._workers = range(num_workers)
        self.version = 0
        self.seen: dict[int, float] = {}  # joined worker -> last heard from
        self.joined: set[int] = set()  # every worker that ever joined
        self.left: set[int] = set()  # workers done with all their steps
        self._started = clock()
        self.lost: dict[int, str] = {}  # worker -> why
        self.clocks = {w: 0 for w in self._workers}
        self.aborted: str | None = None
        self.stopped = False
        self._partial: dict[int, dict[int, set[int]]] = {w: {} for w in self._workers}  # worker -> step -> keys
        self._sum: dict[int, torch.Tensor] = {}  # sync: key -> sum of the step's gradients
        self._rows: dict[int, list] = {}  # sync, pushed by rows: key -> [(ids, rows), ...] of the step
        self._pushed: dict[int, set[int]] = {}  # sync: key -> workers that pushed it this step
        self._updated: set[int] = set()  # sync: keys already updated in this step
        self._step_lr: float | None = None  # sync: the learning rate this step's pushes carry
        self._step_hold: bool | None = None  # sync: whether this step's pushes hold the update for a clip
        self._held: dict[int, torch.Tensor] = {}  # sync, held step: key -> its averaged gradient
        self._sq: dict[int, float] = {}  # held step -> sum of squares of its averaged gradient here
        self._scale: dict[int, float] = {}  # held step -> the clip coefficient it was updated with
        self._deferred: list[_Deferred] = []
        self.counters = dict(updates=0, pushes=0, pulls=0, joins=0, bytes_in=0, bytes_out=0, malformed=0, rejected=0,
                             rows_pushed=0, rows_pulled=0, row_collisions=0)
        self.staleness: dict[int, int] = {}
        self.waits = dict(count=0, total_s=0.0, max_s=0.0)
        self.max_clock_gap = 0
        self._last_malformed_log = float("-inf")
        self._snap: dict[int, dict] = {}  # key -> {wire dtype or None: its values as of its last update}
        self._spare: dict[tuple, list[torch.Tensor]] = {}  # (key, wire dtype) -> former snapshots, for reuse

    # -- the handler -------------------------------------------------------------------------

    def handle(self, peer: bytes, frames: Sequence[Any]) -> list[Reply]:
        """Handle one request; return the replies to send (possibly to other, deferred peers)."""
        self.counters["bytes_in"] += _nbytes(frames)
        if self.aborted:
            return [self._error(peer, *peek_ids(frames), self.aborted)]
        try:
            msg = decode(frames, self.layout, self._workers, self._limits, shard=self.shard,
                         wire=self.config.wire_dtype)
        except Exception as e:  # ProtocolError; anything else is a decoder bug, still not fatal
            text = str(e) if isinstance(e, ProtocolError) else f"undecodable message: {type(e).__name__}: {e}"
            self.counters["malformed"] += 1
            now = self.clock()
            if now - self._last_malformed_log >= 5.0:  # a hostile peer must not flood the log
                self._last_malformed_log = now
                log.warning("shard %d: malformed message from peer %r: %s (%d so far)",
                            self.shard, peer, text, self.counters["malformed"])
            return [self._error(peer, *peek_ids(frames), f"shard {self.shard}: {text}")]
        try:
            w = msg.worker
            if msg.op in REPLIES:
                raise _Reject(f"expected a request, got a {msg.op!r} message")
            if w in self.lost:
                raise _Reject(f"worker {w} was declared lost: {self.lost[w]}")
            if msg.op != "join" and w not in self.seen:
                raise _Reject(f"worker {w} has not joined; send join first", code="not_joined")
            self.seen[w] = self.clock()
            replies = getattr(self, f"_on_{msg.op}")(peer, msg)
        except _Reject as e:
            self.counters["rejected"] += 1
            log.info("shard %d: rejected %s from worker %d: %s", self.shard, msg.op, msg.worker, e)
            return [self._error(peer, msg.worker, msg.req, f"shard {self.shard}: {e}", e.code)]
        except Exception as e:  # a bug or an optimizer failure must not take the shard down silently
            self.counters["rejected"] += 1
            log.exception("shard %d: internal error on %s from worker %d", self.shard, msg.op, msg.worker)
            return [self._error(peer, msg.worker, msg.req, f"shard {self.shard}: internal error: {type(e).__name__}: {e}")]
        return replies + self._release()

    def tick(self) -> list[Reply]:
        """Periodic work: declare silent workers lost, answer pulls now ready or out of time."""
        now = self.clock()
        if not self.aborted and now - self._started > self.config.timeout_s:
            for w in self._workers:
                if w not in self.joined and w not in self.lost:
                    self._lose(w, f"worker {w} did not join within timeout_s={self.config.timeout_s:g} s")
        for w, seen in list(self.seen.items()):
            if not self.aborted and w not in self.lost and now - seen > self.config.worker_timeout_s:
                self._lose(w, f"worker {w} silent for {now - seen:.2f} s (worker_timeout_s={self.config.worker_timeout_s:g})")
        replies = self._release()
        # A final pull waits as long as the workers it waits for are alive: liveness bounds it.
        for d in [d for d in self._deferred if now >= d.deadline and not d.msg.get("wait_left")]:
            self._deferred.remove(d)
            replies.append(self._error(d.peer, d.msg.worker, d.msg.req,
                                       f"shard {self.shard}: {d.msg.op} waited {now - d.since:.2f} s "
                                       f"(timeout_s={self.config.timeout_s:g}) for {self._wait_reason(d.msg)}"))
        if self.aborted:
            replies += [self._error(d.peer, d.msg.worker, d.msg.req, self.aborted) for d in self._deferred]
            self._deferred.clear()
        return replies

    # -- ops -----------------------------------------------------------------------------------

    def _on_join(self, peer: bytes, msg: Message) -> list[Reply]:
        if msg.worker in self.left:
            raise _Reject(f"worker {msg.worker} has already left this run")
        self._check_settings(msg.worker, msg.get("settings"))
        self.joined.add(msg.worker)
        self.counters["joins"] += 1
        body = {"layout": self.layout.to_wire(), "shard": self.shard, "mode": self.mode,
                "num_workers": self.num_workers, "fingerprint": self.layout.fingerprint,
                "clock": self.clocks[msg.worker]}
        return [self._values(peer, msg, self.keys, exact=True, body=body)]

    def _on_init(self, peer: bytes, msg: Message) -> list[Reply]:
        raise _Reject("this shard already has its model; init is sent once, by worker 0, before any join")

    def _on_leave(self, peer: bytes, msg: Message) -> list[Reply]:
        self.left.add(msg.worker)
        self.seen.pop(msg.worker, None)  # no longer watched for liveness
        log.info("shard %d: worker %d left", self.shard, msg.worker)
        if self.mode == "sync":
            self._maybe_step()
        return [self._ok(peer, msg)]

    def _check_settings(self, w: int, theirs: dict[str, Any] | None) -> None:
        if self.settings is None or theirs is None:
            return
        first_w, first = self._first_settings or (w, theirs)
        diff = []
        for key in sorted(set(theirs) | set(self.settings) | set(first)):
            mine, who = (self.settings, f"shard {self.shard}") if key in self.settings else (first, f"worker {first_w}")
            a, b = theirs.get(key, "(unset)"), mine.get(key, "(unset)")
            if a != b:
                diff.append(f"{key}: worker {w} has {a!r}, {who} has {b!r}")
        if diff:
            raise _Reject(f"worker {w} was started with other settings than the run's: {', '.join(diff)}; "
                          "start every process of a run with the same experiment, --steps, --seed and --set")
        self._first_settings = self._first_settings or (w, theirs)

    @property
    def finished(self) -> bool:
        """Every worker has left or is lost: nothing more will come."""
        return len(self.left | set(self.lost)) == self.num_workers

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
            if self.mode != "sync":
                raise _Reject("a clip 'scale' is for sync steps that hold their update")
            self._apply_held(msg)
        self.counters["pulls"] += 1
        return self._answer_or_defer(peer, msg, fields)

    def _on_norm(self, peer: bytes, msg: Message) -> list[Reply]:
        """The sum of squares of held step `step`'s averaged gradient on this shard, once every
        key of it is in."""
        if self.mode != "sync":
            raise _Reject("'norm' is for sync steps that hold their update")
        return self._answer_or_defer(peer, msg, {})

    def _on_wait(self, peer: bytes, msg: Message) -> list[Reply]:
        """Answer, without values, once this shard's version reaches min_version (the whole
        step done, not only some keys); else once it does."""
        return self._answer_or_defer(peer, msg, {})

    def _answer_or_defer(self, peer: bytes, msg: Message, fields: dict) -> list[Reply]:
        if self._pull_ready(msg):
            return [self._answer(peer, msg, **fields)]
        now = self.clock()
        self._deferred.append(_Deferred(peer, msg, now, now + self.config.timeout_s, fields))
        return []

    def _answer(self, peer: bytes, msg: Message, **fields: Any) -> Reply:
        """The reply to a pull (its values) or a wait (the version) whose condition holds."""
        if msg.op == "wait":
            return self._ok(peer, msg, version=self.version, **fields)
        if msg.op == "norm":
            return self._ok(peer, msg, version=self.version, sq=self._sq[msg.get("step")], **fields)
        self._note_gap(msg)
        return self._values(peer, msg, msg.keys or self.keys, exact=bool(msg.get("wait_left")), **fields)

    def _on_push(self, peer: bytes, msg: Message) -> list[Reply]:
        w, step, version = msg.worker, msg.get("step"), msg.get("version")
        if not msg.keys:
            raise _Reject("push names no keys")
        if version > self.version:
            raise _Reject(f"push says its gradient was computed on version {version}, "
                          f"but this shard is only at version {self.version}")
        if step < self.clocks[w]:
            raise _Reject(f"worker {w} already pushed all keys of step {step} (its clock is {self.clocks[w]})")
        if self.mode == "sync" and step != self.version:
            raise _Reject(f"sync push for step {step}, but the shard is at step {self.version}; "
                          f"pull with min_version={step} first")
        done = self._partial[w].get(step, set())
        twice = [k for k in msg.keys if k in done]
        if twice:
            raise _Reject(f"worker {w} pushed key(s) {twice} of step {step} twice")
        hold = bool(msg.get("hold"))
        if hold and (self.mode != "sync" or msg.get("pull") or any(i is not None for i in msg.ids)):
            raise _Reject("a push holds its update ('hold') only under sync, of whole keys, without 'pull': "
                          "the values come with the pull that carries the step's clip 'scale'")
        if self.mode == "sync" and self._step_hold is not None and hold != self._step_hold:
            raise _Reject(f"worker {w} pushed step {step} {'with' if hold else 'without'} 'hold', another "
                          f"worker {'without' if hold else 'with'}: every worker must clip, or none")
        lr = msg.get("lr")
        if self.mode == "sync" and lr is not None and self._step_lr not in (None, lr):
            raise _Reject(f"worker {w} pushed step {step} with lr={lr:g}, another worker with "
                          f"lr={self._step_lr:g}: every worker must run the same learning-rate schedule")
        # validated: from here on the push is applied
        if self.config.wire_dtype:  # compressed on the wire: back to the master values' dtype
            msg.tensors[:] = [g.to(self.chunks[k].dtype) for k, g in zip(msg.keys, msg.tensors)]
        ids = msg.ids or [None] * len(msg.keys)
        stale = self.version - version
        self.staleness[stale] = self.staleness.get(stale, 0) + 1
        self.counters["pushes"] += 1
        self.counters["rows_pushed"] += sum(i.numel() for i in ids if i is not None)
        if self.mode == "sync":
            self._step_lr = lr if lr is not None else self._step_lr
            self._step_hold = hold
            for k, g, i in zip(msg.keys, msg.tensors, ids):
                if i is not None:
                    self._rows.setdefault(k, []).append((i, g))
                elif k in self._sum:
                    self._sum[k].add_(g)
                else:
                    self._sum[k] = g  # built on the received frame, which is ours to keep and write
                self._pushed.setdefault(k, set()).add(w)
            self._note_keys(w, step, msg.keys)
            self._maybe_step()
        else:
            live = self.num_workers - len(self.lost)
            scale = 1.0 / live if self.config.async_scale == "mean" else 1.0
            for k, g, i in zip(msg.keys, msg.tensors, ids):
                g = g * scale if scale != 1.0 else g
                if i is not None:
                    self._note_collisions(k, w, i)
                self.chunks[k].grad = self._grad(k, g, i)  # optimizers only read it
            self._apply(msg.keys, f"apply push of worker {w} (step {step})", lr=lr)
            if self._note_keys(w, step, msg.keys):
                self._bump()
        if msg.get("pull"):  # the pushed keys' values, under the push's own conditions
            conditions = {f: msg.get(f) for f in ("min_version", "clock") if msg.get(f) is not None}
            pull = Message({"op": "pull", "v": msg.get("v"), "worker": w, "req": msg.req, "keys": msg.keys,
                            **conditions})
            return self._on_pull(peer, pull, staleness=stale)
        return [self._ok(peer, msg, staleness=stale, version=self.version)]

    def _grad(self, k: int, g: torch.Tensor, ids: torch.Tensor | None, coalesced: bool = True) -> torch.Tensor:
        """A pushed gradient as the optimizer's grad of chunk k: dense, or sparse over the rows
        `ids` (which must be coalesced, unless coalesced=False)."""
        chunk = self.chunks[k]
        if ids is None:
            return g.reshape(chunk.shape)
        grad = torch.sparse_coo_tensor(ids.unsqueeze(0), g, chunk.shape, is_coalesced=coalesced,
                                       check_invariants=False)
        return grad if coalesced else grad.coalesce()

    def _note_collisions(self, k: int, w: int, ids: torch.Tensor) -> None:
        """Count the rows of w's push that another worker's push changed after w last pulled
        (its gradient was computed on values since overwritten), then mark them as w's."""
        writer, changed = self._row_writer[k][ids], self._row_update[k][ids]
        read = self._read_at.get(w, 0)
        self.counters["row_collisions"] += int(((writer >= 0) & (writer != w) & (changed > read)).sum())
        self._row_writer[k][ids] = w
        self._row_update[k][ids] = self.counters["updates"] + 1  # the update this push makes

    # -- state ---------------------------------------------------------------------------------

    def _live(self) -> set[int]:
        return set(self._workers) - set(self.lost) - self.left

    def _apply(self, keys, label: str, count: bool = True, lr: float | None = None) -> None:
        """One optimizer step over the chunks of `keys`, whose grads are set (the optimizers
        skip every chunk without one), at learning rate lr (None: the optimizer's). count: it
        is an update of the shard (the counter)."""
        start = time.time()
        for k in keys:
            self._own(k)
        self.optimizer.step(keys, lr)
        for k in keys:
            self.chunks[k].grad = None
            for wire, old in self._snap.pop(k, {}).items():
                spares = self._spare.setdefault((k, wire), [])
                if len(spares) < SPARE_SNAPSHOTS:
                    spares.append(old)
        self.counters["updates"] += int(count)
        if self.trace is not None:
            self.trace(label, start, time.time(), thread=f"shard {self.shard}", version=self.version)

    def _note_keys(self, w: int, step: int, keys: list[int]) -> bool:
        """Record keys pushed by w for step; True when that completes the step on this shard."""
        partial = self._partial[w]
        done = partial.setdefault(step, set())
        done.update(keys)
        if len(done) < len(self.keys):
            while len(partial) > PARTIAL_STEPS:  # a worker that never pushes some keys: bounded memory
                del partial[min(partial)]
            return False
        self.clocks[w] = step + 1
        self._partial[w] = {s: ks for s, ks in self._partial[w].items() if s > step}
        return True

    def _maybe_step(self) -> None:
        """sync: update each key every live worker has pushed; once all are, the step is done.
        A held step (a clip) keeps the averaged gradients until a pull brings the scale."""
        live = self._live()
        if not live:
            return
        ready = [k for k in self._pushed if k not in self._updated and k not in self._held
                 and live <= self._pushed[k]]
        for k in ready:
            count = len(self._pushed[k])
            if k in self._rows:  # every worker's rows, duplicates summed
                parts = self._rows.pop(k)
                grad = self._grad(k, torch.cat([g for _, g in parts]), torch.cat([i for i, _ in parts]),
                                  coalesced=len(parts) == 1)
                grad = grad / count
            else:
                grad = self._sum.pop(k).reshape(self.chunks[k].shape).div_(count)
            if self._step_hold:
                self._held[k] = grad
            else:
                self.chunks[k].grad = grad
        if self._step_hold:
            if ready and len(self._held) == len(self.keys):  # the step's gradient is complete here
                self._sq[self.version] = float(sum(self._held[k].double().pow(2).sum() for k in self.keys))
            return
        if ready:
            named = f"key {ready[0]}" if len(ready) == 1 else f"keys {ready[0]}..{ready[-1]} ({len(ready)})"
            self._apply(ready, f"update {named} (step {self.version}, {len(live)} workers)", count=False,
                        lr=self._step_lr)
            self._updated.update(ready)
        if len(self._updated) == len(self.keys):
            self._end_step()

    def _end_step(self) -> None:
        self.counters["updates"] += 1
        self._step_lr = self._step_hold = None
        self._updated.clear()
        self._pushed.clear()
        self._rows.clear()
        self._bump()

    def _apply_held(self, msg: Message) -> None:
        """A pull with the held step's clip scale: the first makes the update (every key's
        averaged gradient times the scale); later ones must bring the same scale."""
        step, scale = msg.get("min_version", self.version + 1) - 1, msg.get("scale")
        if step in self._scale:
            if self._scale[step] != scale:
                raise _Reject(f"worker {msg.worker} pulled step {step} with scale {scale!r}, the step was "
                              f"updated with {self._scale[step]!r}: every worker must compute the same clip")
            return
        if step != self.version or step not in self._sq:
            raise _Reject(f"worker {msg.worker} sent a clip scale for step {step}, but this shard (at step "
                          f"{self.version}) holds {'no' if not self._held else 'an incomplete'} step to scale")
        for k, g in self._held.items():
            self.chunks[k].grad = g.mul_(scale) if scale != 1.0 else g
        keys = list(self._held)
        self._apply(keys, f"update, clipped by {scale:.6g} (step {step})", count=False, lr=self._step_lr)
        self._scale[step] = scale
        for kept in (self._scale, self._sq):  # a few steps back, for workers that read them late
            for old in [s for s in kept if s < step - 4]:
                del kept[old]
        self._held.clear()
        self._updated.update(keys)
        self._end_step()

    def _version_of(self, keys) -> int:
        """The version the values of `keys` are at: sync keys updated in the current step are
        one ahead of the shard."""
        if self.mode != "sync" or not self._updated:
            return self.version
        return self.version + int(all(k in self._updated for k in keys))

    def _pull_ready(self, msg: Message) -> bool:
        min_version, clock = msg.get("min_version"), msg.get("clock")
        if msg.op == "wait":
            return self.version >= min_version
        if msg.op == "norm":
            return msg.get("step") in self._sq
        if msg.get("wait_left") and any(w != msg.worker for w in self._live()):
            return False
        if min_version is not None and self._version_of(msg.keys or self.keys) < min_version:
            return False
        if self.mode == "ssp" and clock is not None:
            live = self._live()
            return not live or clock - min(self.clocks[w] for w in live) <= self.config.staleness
        return True

    def _wait_reason(self, msg: Message) -> str:
        parts = []
        if msg.op == "norm":
            parts.append(f"every key of held step {msg.get('step')} (shard at step {self.version}, "
                         f"{len(self._held)} of {len(self.keys)} keys in)")
        if msg.get("min_version") is not None:
            parts.append(f"version >= {msg.get('min_version')} (shard at version {self.version})")
        if self.mode == "ssp" and msg.get("clock") is not None:
            live = self._live()
            slow = min(live, key=lambda w: (self.clocks[w], w)) if live else None
            parts.append(f"clock {msg.get('clock')} to be within staleness {self.config.staleness} of the "
                         f"slowest live worker (worker {slow} at clock {self.clocks.get(slow)})")
        if msg.get("wait_left"):
            others = sorted(w for w in self._live() if w != msg.worker)
            parts.append(f"workers {others} to leave")
        return " and ".join(parts) or "nothing"

    def _release(self) -> list[Reply]:
        """Answer the deferred pulls and waits whose condition now holds."""
        if self.aborted:
            return []
        replies, now = [], self.clock()
        for d in [d for d in self._deferred if self._pull_ready(d.msg)]:
            self._deferred.remove(d)
            waited = now - d.since
            self.waits["count"] += 1
            self.waits["total_s"] += waited
            self.waits["max_s"] = max(self.waits["max_s"], waited)
            replies.append(self._answer(d.peer, d.msg, waited_us=int(waited * 1e6), **d.fields))
        return replies

    def _lose(self, w: int, reason: str) -> None:
        self.lost[w] = reason
        if self.config.loss_policy(self.mode) == "abort":
            self.aborted = f"shard {self.shard} aborted: {reason}"
            log.error("%s", self.aborted)
            return
        log.warning("shard %d: dropping %s; continuing with workers %s", self.shard, reason, sorted(self._live()))
        self._partial[w] = {}
        if self.mode == "sync":
            self._maybe_step()

    # -- replies -------------------------------------------------------------------------------

    def _send(self, peer: bytes, frames: list) -> Reply:
        self.counters["bytes_out"] += _nbytes(frames)
        return peer, frames

    def _ok(self, peer: bytes, msg: Message, **fields: Any) -> Reply:
        return self._send(peer, encode({"op": "ok", "worker": msg.worker, "req": msg.req, **fields}))

    def _error(self, peer: bytes, worker: int, req: int, text: str, code: str | None = None) -> Reply:
        return self._send(peer, error_reply(worker, req, text, code))

    def _note_gap(self, msg: Message) -> None:
        """How far ahead of the slowest live worker a pull lets its worker run (any mode)."""
        clock, live = msg.get("clock"), self._live()
        if clock is not None and live:
            self.max_clock_gap = max(self.max_clock_gap, clock - min(self.clocks[w] for w in live))

    def _values(self, peer: bytes, msg: Message, keys: list[int], exact: bool = False, **fields: Any) -> Reply:
        """The values of keys, in the wire dtype under compression unless exact (join, the
        final pull, checkpoint: what the worker keeps must be the master values); of the rows
        a pull names, for a pull by rows."""
        header = {"op": "ok", "worker": msg.worker, "req": msg.req, "version": self._version_of(keys),
                  "keys": list(keys)}
        if msg.op == "pull":
            self._read_at[msg.worker] = self.counters["updates"]
        if msg.op != "pull" or not msg.ids:
            return self._send(peer, encode({**header, **fields}, [self._snapshot(k, exact) for k in keys]))
        wire = TORCH_DTYPES[self.config.wire_dtype] if self.config.wire_dtype and not exact else None
        tensors = []
        for k, i in zip(keys, msg.ids):
            if i is None:
                tensors.append(self._snapshot(k, exact))
            else:  # index_select copies: the reply never points into the chunk
                rows = self.chunks[k].detach().index_select(0, i)
                tensors.append(rows.to(wire) if wire is not None else rows)
                self.counters["rows_pulled"] += i.numel()
        return self._send(peer, encode({**header, **fields}, tensors, msg.ids))

    def _snapshot(self, k: int, exact: bool = False) -> torch.Tensor:
        """The values of chunk k as of its last update, to leave in a reply: the chunk itself
        (flat), or under compression (unless exact) a copy in the wire dtype shared by every
        reply until the next update. Replies leave zero-copy; a chunk a reply still points
        at is moved before it is written (_own), and a copy is never written while a reply
        may point at it."""
        if exact or not self.config.wire_dtype:
            return self.chunks[k].detach().reshape(-1)
        wire = TORCH_DTYPES[self.config.wire_dtype]
        copies = self._snap.setdefault(k, {})
        if wire not in copies:
            flat = self.chunks[k].detach().reshape(-1)
            spare = self._free_spare((k, wire))
            copies[wire] = spare.copy_(flat) if spare is not None else flat.to(wire)
        return copies[wire]

    def _own(self, k: int) -> None:
        """Make chunk k's memory the shard's alone before it is written: if a reply still
        points at it (ZeroMQ has not sent it yet), the chunk moves to a copy (in a spare
        buffer) and the reply keeps the former memory. Under sync the next update of a key
        comes only after every worker has its values, so this copies only when a reply is
        late (async, ssp, a slow link)."""
        chunk = self.chunks[k]
        if not _in_use(chunk):
            return
        spare = self._free_spare((k, None))
        moved = spare.copy_(chunk.detach()) if spare is not None else chunk.detach().clone()
        former = chunk.detach()  # keeps the memory the reply points at; a spare once it is sent
        chunk.data = moved  # the same tensor to the optimizer (its state is keyed by it)
        del moved
        spares = self._spare.setdefault((k, None), [])
        if len(spares) < SPARE_SNAPSHOTS:
            spares.append(former)

    def _free_spare(self, pool: tuple) -> torch.Tensor | None:
        """A buffer of pool no reply points at any more (the newest first), taken out of it."""
        spares = self._spare.get(pool, [])
        free = next((i for i in reversed(range(len(spares))) if not _in_use(spares[i])), None)
        return spares.pop(free) if free is not None else None

    def _bump(self) -> None:
        self.version += 1
        if self.save is not None and self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self.save(self.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this shard: values, optimizer state, version, clocks."""
        return {"shard": self.shard, "fingerprint": self.layout.fingerprint, "version": self.version,
                "values": {k: t.detach().reshape(-1).clone() for k, t in self.chunks.items()},
                "optimizer": self.optimizer.state_dict(),
                "clocks": dict(self.clocks), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); refuses a checkpoint of another shard or layout."""
        if state.get("shard") != self.shard or state.get("fingerprint") != self.layout.fingerprint:
            raise ValueError(f"checkpoint is of shard {state.get('shard')} with layout "
                             f"{str(state.get('fingerprint'))[:12]}, not shard {self.shard} with layout "
                             f"{self.layout.fingerprint[:12]}: same experiment, --set and --shard?")
        with torch.no_grad():
            for k, t in state["values"].items():
                self._own(k)
                self.chunks[k].copy_(t.reshape(self.chunks[k].shape))
        self.optimizer.load_state_dict(state.get("optimizer") or {})
        self.version = int(state["version"])
        self.clocks.update({int(w): int(c) for w, c in state["clocks"].items()})
        self.counters.update(state["counters"])
        self._snap = {}

    def stats(self) -> dict[str, Any]:
        """Counters as a plain dict (str keys, msgpack-able)."""
        return {
            "shard": self.shard, "mode": self.mode, "version": self.version, **self.counters,
            "staleness": {str(s): n for s, n in sorted(self.staleness.items())},
            "queue_wait": dict(self.waits), "deferred": len(self._deferred),
            "joined_workers": sorted(self.joined), "live_workers": sorted(self._live()),
            "left_workers": sorted(self.left),
            "lost_workers": {str(w): why for w, why in self.lost.items()},
            "clocks": {str(w): c for w, c in self.clocks.items()}, "aborted": self.aborted,
            "max_clock_gap": self.max_clock_gap,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # of the process
        }

    # -- the loop ------------------------------------------------------------------------------

    def serve(self, transport: Any, stop_event: threading.Event | None = None,
              report: tuple[float, Callable[[dict], None]] | None = None) -> str:
        """Receive, handle, reply until every worker has left ("finished"), shutdown, abort or
        stop_event; returns why it ended. report=(period_s, fn): fn(stats()) every period_s
        and once at the end, from this loop's thread (so the counters are never read mid-update).

        After an abort it goes on answering errors for a short grace period (so that waiting
        workers learn why), then ends.
        """
        poll_s = min(0.1, self.config.heartbeat_s / 2, self.config.worker_timeout_s / 4)
        grace_s = min(self.config.timeout_s, max(0.5, 2 * self.config.heartbeat_s))
        abort_at = None
        held: list[tuple[float, int, bytes, list]] = []  # replies waiting out reply_delay_s
        sequence = 0
        next_report = self.clock() + report[0] if report else float("inf")
        try:
            while not (stop_event is not None and stop_event.is_set()):
                if self.clock() >= next_report:
                    report[1](self.stats())
                    next_report += report[0]
                wait_s = poll_s if not held else max(0.0, min(poll_s, held[0][0] - self.clock()))
                item = transport.recv(wait_s)
                replies = self.handle(*item) if item is not None else []
                replies += self.tick()
                now = self.clock()
                for peer, frames in replies:
                    sequence += 1
                    heapq.heappush(held, (now + self.reply_delay_s, sequence, peer, frames))
                while held and held[0][0] <= now:
                    _, _, peer, frames = heapq.heappop(held)
                    transport.send(peer, frames)
                replies = frames = item = None  # sent: nothing here keeps a reply's snapshot in use
                if held:
                    continue
                if self.stopped:
                    return "shutdown"
                if self.finished and not self.aborted and not self._deferred:
                    return "finished"
                if self.aborted:
                    abort_at = abort_at if abort_at is not None else self.clock() + grace_s
                    if self.clock() >= abort_at:
                        return self.aborted
            return "stopped"
        finally:
            if report:
                report[1](self.stats())


NOT_INITIALIZED = "has no model yet"
"""Error text of a shard awaiting init (code "not_initialized": a client's join retries on it)."""


class _NotInitialized(ProtocolError):
    """A request other than init to a shard that has no model yet."""


def await_init(transport: Any, shard: int, num_shards: int,
               make: Callable[[Layout, dict[int, torch.Tensor], dict[str, Any]], ShardServer],
               timeout_s: float, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
               stop_event: threading.Event | None = None) -> ShardServer | None:
    """Serve a shard started without a model (a user's script) until worker 0's init arrives.

    init carries body {"layout": Layout.to_wire(), "optim": {name: scalar}} and the initial
    values of this shard's keys, checked against that layout like any push. Every other
    request gets an error saying the shard has no model yet (a join is retried on it).
    make(layout, values, optim) builds the ShardServer (a ValueError from it, e.g. an
    optimizer it cannot run, is the error reply). Returns it once init is answered; None if
    stop_event is set. TimeoutError after timeout_s without an init.
    """
    deadline = clock() + timeout_s
    while not (stop_event is not None and stop_event.is_set()):
        if clock() > deadline:
            raise TimeoutError(f"shard {shard}: worker 0 sent no init (its model's layout and initial "
                               f"values) within {timeout_s:g} s; is the script calling attach()?")
        item = transport.recv(0.1)
        if item is None:
            continue
        peer, frames = item
        try:
            server = _init_from(frames, shard, num_shards, make, limits)
        except (ProtocolError, ValueError, TypeError) as e:
            code = "not_initialized" if isinstance(e, _NotInitialized) else None
            transport.send(peer, error_reply(*peek_ids(frames), f"shard {shard}: {e}", code))
            continue
        msg = decode(frames, server.layout, limits=limits, shard=shard)
        transport.send(peer, encode({"op": "ok", "worker": msg.worker, "req": msg.req}))
        log.info("shard %d: initialized by worker 0 with %r", shard, server.layout)
        return server
    return None


def _init_from(frames: Sequence[Any], shard: int, num_shards: int, make, limits: Limits) -> ShardServer:
    msg = decode(frames, None, limits=limits)
    if msg.op != "init":
        raise _NotInitialized(f"this shard {NOT_INITIALIZED}: worker 0 sends it first (init); "
                              f"{msg.op} must wait")
    if msg.worker != 0:
        raise ProtocolError(f"init comes from worker 0, not worker {msg.worker}")
    body = msg.get("body")
    if set(body) != {"layout", "optim"} or not isinstance(body["optim"], dict):
        raise ProtocolError(f"init body must hold 'layout' and 'optim' (a dict); got {sorted(body)}")
    try:
        layout = Layout.from_wire(body["layout"])
    except ValueError as e:
        raise ProtocolError(f"init: invalid layout: {e}") from e
    if layout.num_shards != num_shards:
        raise ProtocolError(f"init: the layout has {layout.num_shards} shards, this run {num_shards}")
    msg = decode(frames, layout, limits=limits, shard=shard)  # keys, dtypes, shapes, frame sizes
    expected = [k.id for k in layout.shard_keys(shard)]
    if msg.keys != expected:
        raise ProtocolError(f"init: values for keys {msg.keys[:8]}, expected this shard's keys {expected[:8]}")
    return make(layout, dict(zip(msg.keys, msg.tensors)), body["optim"])
