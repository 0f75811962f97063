"""The parameter-server engines (ps-sync, ps-async, ps-ssp) on the worker side.

Gradient hooks push each parameter's chunks to their shards as soon as backward has
produced them, so pushes overlap the rest of backward and go to every shard at once; small
gradients wait in a bucket (ps.bucket_kb, as DDP's buckets) so that they leave together, one
message per shard. Under
sync that message also asks for the bucket's next values (push+pull), which a shard sends,
as its reply, as soon as every worker has pushed them: the values of early buckets come back
while later ones are still being pushed (ps.exchange=pipelined); or, with ps.exchange=phased,
the worker pulls only once every shard has finished the step, so that no reply shares a
link with a push (shards co-located with workers). Under async and ssp each push asks for
its keys' values once it is applied (ssp: within the staleness bound), so they too come back
while later pieces leave. `step()` waits for the pushes and the pulls and copies the values
into the model; under ps-sync with ps.order=forward it leaves the push+pulls' values to the
next forward, which takes each module's as it reaches it (ps/forward_loads.py). The buckets,
the tables moved by rows and what a script does between backward and step are mixins of
their own (ps/engine_buckets.py, ps/engine_rows.py, ps/engine_script.py). The optimizer runs on the servers, so the `make_optimizer` given to attach is
not used here.

Downpour SGD (ps.push_every, ps.fetch_every): a worker steps its own optimizer on each step's
gradient, pushes the sum of its gradients since its last push every push_every steps, and
every fetch_every steps replaces its values with the shards'. With both 1 a step is the
engine's plain one (the local step is overwritten by the fetch).

Under compress.method (ps.codec) each dense key's gradient leaves compressed, with this
worker's error feedback (compensate, compress, remember what the message carried), and under
sync the replies may carry the compressed gradient the shards' update applied instead of the
values: step() then applies the same optimizer step to it, with an optimizer of its own
(`make_optimizer`), and the model follows the shards' values bit for bit.

Buffers (BatchNorm running statistics) stay with each worker: rank 0's, the ones saved and
evaluated, follow shard 0 as in every other engine.

Embedding tables the shards hold row-sparse (the layout's `sparse` parameters) travel by
rows: their modules make sparse gradients, and a push carries only the rows the batch
touched (summed, per key), and only the rows the next batch reads are pulled (under sync,
as of the update of the step before): asked for after backward when the loop announces them
(prefetch), else by a forward pre-hook before the lookup. Rows nobody reads stay stale
in the worker's copy, which is never a second dense copy of the table; the final pull reads
them all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from .client import PeerTimeout, PSClient, PSError
from .config import PSConfig
from .engine_buckets import Buckets
from .engine_rows import RowTables
from .engine_script import ScriptSteps
from .script_state import ScriptState
from .forward_loads import ForwardLoads, nothing_late
from .layout import ParamSpec
from .protocol import MODES

log = logging.getLogger("psar.ps.engine")


class PSEngine(Buckets, RowTables, ScriptSteps, ScriptState):
    """Engine protocol (attach / backward / step / close) over server shards at `addresses`."""

    values_on_shards = True
    """The shards hold the parameters: a worker's own change to them would be lost."""

    def __init__(self, rank: int, world: int, device: torch.device, addresses: list[str],
                 mode: str, config: PSConfig, trace=None, settings: dict | None = None,
                 initializer=None, compression=None, rejoin: bool = False, forward_loads: bool = True) -> None:
        """trace: optional callable(name, start, end, thread=...) for every push and pull;
        settings: the run settings the shards compare with theirs at join;
        initializer: for shards started without a model (a user's script): a callable
        (model, make_optimizer) -> (layout, {key: initial values}, optimizer settings) that
        worker 0 sends them (init) before anyone joins;
        compression: (compressor, error-feedback memory or None) of compress.method, whose
        messages the pushes carry (ps.codec); None: pushes leave whole;
        rejoin: this process replaces a worker of the same rank that died (a restart): it
        joins the running shards again and goes on at their step (sync) or clock;
        forward_loads: under ps.order=forward, whether the next forward may load a step's
        values layer by layer: False where other code may read the parameters between a
        step and the next forward (a user's script), which then get them all in step()."""
        if mode not in MODES:
            raise ValueError(f"parameter-server mode {mode!r}: expected sync, async or ssp")
        if not addresses:
            raise ValueError("the parameter-server engines need server addresses (--servers)")
        self.rank, self.world, self.device, self.mode, self.config = rank, world, device, mode, config
        self.addresses = list(addresses)
        self.trace, self.settings, self.initializer = trace, settings, initializer
        self.rejoin = rejoin
        # ps.order=forward, where step() may leave the values to the next forward: the sync
        # pipelined exchange of whole values, with nothing that needs them all at step's end
        self._lazy = (forward_loads and mode == "sync" and config.order == "forward" and config.exchange == "pipelined"
                      and compression is None and not config.downpour and not config.reconnect_s
                      and not config.backup_workers)
        self._forward: ForwardLoads | None = None  # once attached, where _lazy
        self.compressor, self.memory = compression if compression is not None else (None, None)
        self.compress_s = 0.0  # this step's time compressing pushes (error feedback included)
        self.shards = [rank]
        self._phased = self.mode == "sync" and config.exchange == "phased"  # pull once every shard is done
        self._server_stats: list[dict] = []
        self.schedule: torch.optim.Optimizer | None = None  # a script's job.optimizer: its lr leaves with the pushes
        self._hyper: dict | None = None  # its other settings, which the shards own
        self._pushed_grads: dict[int, tuple[torch.Tensor, int]] = {}  # parameter -> (its grad, version) at push
        self._accumulating = False  # inside no_sync
        self.clip_mode: bool | None = False  # sync: pushes hold their update for a clip; None: not known yet
        self._deferred: list[int] = []  # parameters whose push waits for clip_mode to be known
        self._scale: float | None = None  # the clip coefficient of this step
        self.updates_lost = 0
        config.check_downpour(f"ps-{mode}", mode == "sync", self.compressor.name if self.compressor else "none")
        self.row_pulls = {"prefetched": 0, "at_lookup": 0}  # this worker's pulls of table rows

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # under compressed pulls this worker applies each update's gradient itself; under
        # Downpour it steps on its own gradients between fetches
        self._optimizer = make_optimizer([p for _, p in self._named]) \
            if self.compressor is not None or self.config.downpour else None
        self.client = PSClient(self.addresses, self.rank, timeout_s=self.config.timeout_s,
                               heartbeat_s=self.config.heartbeat_s,
                               max_message_mb=self.config.max_message_mb,
                               curve_dir=self.config.curve_dir, curve_name=self.config.curve_name,
                               compression=self.config.compression,
                               window_mb=self.config.window_mb if self.mode == "sync" else 0.0,
                               compressor=self.compressor)
        if self.initializer is not None and self.rank == 0 and not self.rejoin:
            self.client.init(*self.initializer(model, make_optimizer))
        layout, version, values = self._join()
        mine = [ParamSpec.of(n, p) for n, p in self._named]
        if list(layout.specs) != mine:
            diff = next((f"server has {a}, this worker has {b}" for a, b in zip(layout.specs, mine)
                         if a != b), f"server has {len(layout.specs)} parameters, worker {len(mine)}")
            raise RuntimeError(f"the servers at {', '.join(self.addresses)} hold another model: "
                               f"{diff}; start servers and workers with the same experiment and --set")
        self.layout = layout
        self._load(values)
        self._tables = {i: self._table_module(model, i) for i in sorted(layout.sparse)}
        if self.config.downpour and self._tables:
            raise RuntimeError(f"ps.push_every/ps.fetch_every above 1 step whole parameters locally; the shards hold "
                               f"{', '.join(self._named[i][0] for i in self._tables)} by rows: set ps.sparse=dense")
        if self.compressor is not None and self._tables:
            raise RuntimeError(f"compress.method={self.compressor.name} compresses whole keys; the shards hold "
                               f"{', '.join(self._named[i][0] for i in self._tables)} by rows: set ps.sparse=dense")
        self._dense_keys = [k.id for k in layout.keys if k.param not in layout.sparse]
        self._want = dict(self.client.versions)  # sync: the version each shard's next values have
        self._prefetched: dict[int, tuple] = {}  # table -> (ids, spans, handle, sent at) asked early
        for module in self._tables.values():
            module.sparse = True  # gradients of the rows looked up, never a dense table
        self._prehooks = [module.register_forward_pre_hook(functools.partial(self._pull_rows, i))
                          for i, module in self._tables.items()]
        if self._lazy:  # each module's forward first takes the values of its own parameters
            self._forward = ForwardLoads(self.client, layout, self.config.compression, self._load, self.trace)
            self._prehooks += self._forward.hooks(model, self._named)
        # Sync steps are numbered by the shards' version; async/ssp by this worker's clock
        # (both 0 on a fresh run, where a resumed shard left them).
        self._step = version if self.mode == "sync" else max(self.client.clocks.values(), default=0)
        self._sent, self._received = self.client.bytes_sent, self.client.bytes_recv
        self._pushes = []
        self._pulls = []  # sync: one per bucket, sent right behind its push
        self._bucket: dict[int, object] = {}  # key -> gradient (or rows) waiting to leave
        self._bucket_names: list[str] = []
        self._bucket_dense: list[int] = []  # its keys whose next values a sync pull asks for
        self._bucket_bytes = 0
        self._returned: set[int] = set()  # dense keys whose values come back with their push this step
        self._ready = 0  # parameters whose gradient arrived this step
        self._began, self._backward_s = 0.0, 0.0
        self._released: list[list] = []  # [seconds since backward began, bytes] of each bucket pushed
        self._summed: dict[int, torch.Tensor] = {}  # Downpour: parameter -> its gradients since the last push
        self._pushes_made = self._step if self.mode != "sync" else 0  # async/ssp pushes carry it as their clock
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._push, i))
                       for i, (_, p) in enumerate(self._named)]
        self._mark_values()
        return model

    def _join(self):
        """join; while worker 0 has not given shards without a model theirs, again (bounded)."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                return self.client.join(self.settings, rejoin=self.rejoin)
            except PSError as err:
                if self.initializer is None or err.code != "not_initialized" or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in here only accumulate the gradients; the next backward outside
        it pushes their sum (a sync shard then averages the workers' sums, as DDP does)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _pushing(self) -> bool:
        """Whether this step pushes (Downpour: every push_every steps)."""
        return (self._step + 1) % self.config.push_every == 0

    def _fetching(self) -> bool:
        """Whether this step ends with the shards' values (Downpour: every fetch_every steps)."""
        return (self._step + 1) % self.config.fetch_every == 0

    def _push(self, index: int, param: torch.nn.Parameter) -> None:
        if self._accumulating or not self._pushing():
            return
        self._pushed_grads[index] = (param.grad, param.grad._version)
        if self.clip_mode is None:  # a script's first step: whether it clips decides how it leaves
            self._deferred.append(index)
            return
        self._enqueue(index, param)

    def _load(self, values: dict[int, torch.Tensor]) -> None:
        """Copy {key id: flat values} into the parameters (the keys given, whole)."""
        with torch.no_grad():
            for kid, value in values.items():
                key = self.layout.keys[kid]
                self._named[key.param][1].view(-1)[key.offset: key.offset + key.numel].copy_(value)

    def _local_step(self) -> None:
        """Downpour: keep this step's gradient for the next push (unless it left now), then
        step this worker's own optimizer on it (a fetch then replaces the values)."""
        pushed = self._pushing()
        for i, (_, p) in enumerate(self._named):
            if p.grad is not None and not pushed:
                self._summed[i] = self._summed[i].add_(p.grad.reshape(-1)) if i in self._summed \
                    else p.grad.detach().reshape(-1).clone()
        self._step_own()

    def _step_own(self) -> None:
        """One step of this worker's own optimizer on its parameters' .grad, at the learning
        rate of the script's schedule where it has one (as the pushes carry it)."""
        lr = self._lr()
        if lr is not None:
            for group in self._optimizer.param_groups:
                group["lr"] = lr
        self._optimizer.step()

    def _apply(self, grads: dict[int, torch.Tensor]) -> None:
        """Compressed pulls: one optimizer step with {key id: the gradient the shards applied}
        (every key of a parameter, or none), at the learning rate the pushes carried."""
        if not grads:
            return
        for kid, grad in grads.items():
            key = self.layout.keys[kid]
            param = self._named[key.param][1]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.view(-1)[key.offset: key.offset + key.numel].copy_(grad)
        self._step_own()
        for _, p in self._named:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        self.settle()  # values of parameters this step's forward did not use
        self._check_values()
        self._began, self._released = time.perf_counter(), []
        loss.backward()
        self._backward_s = time.perf_counter() - self._began

    def settle(self, counted: bool = True) -> None:
        """Take every value the last step left to the next forward (ps.order=forward): the
        parameters then hold the shards' values (counted: the wait is this step's
        communication)."""
        if self._forward is not None:
            self._forward.settle(counted)

    def step(self) -> dict:
        start = time.perf_counter()
        self.settle(counted=False)  # a step without a forward since the last
        self._check_script()
        if self.clip_mode is None:  # the script's first step did not clip: it never will
            self._release_deferred(False)
        if self._pushing():
            self._flush(None if self.mode == "sync" else self._pushes_made)  # parameters that got no gradient
        if self.clip_mode:  # the step's values, updated with its clip (1: the script skipped it)
            if self._scale is None:
                self.client.wait(self.client.norm())  # the step complete on every shard first
            scale, self._scale = self._scale if self._scale is not None else 1.0, None
            self._pulls.append((f"step {self._step}", time.time(),
                                self.client.pull(self._dense_keys, next_version=True, scale=scale)))
        self._ready = 0
        # The pull goes out at once, behind the pushes on each shard's connection (ZeroMQ keeps
        # their order), so it costs no extra round trip.
        try:
            rest = [k for k in self._dense_keys if k not in self._returned]  # not answered with their push
            if self.mode != "sync" and rest and self._fetching():
                # ssp waits on the clock; async sends it only so the server can record the gap
                clock = self._pushes_made + int(self._pushing())
                self._pulls = [(f"step {self._step}", time.time(), self.client.pull(rest, clock=clock))]
            self._returned = set()
            waited = self._phase() if self._phased else 0.0
            deferred = self._forward.defer(self._pushes) if self._forward is not None else set()  # to the next forward
            pushes = [entry for entry in self._pushes if id(entry[2]) not in deferred]
            pushed = [self.client.wait(h) for _, _, h in pushes]
            pulled = [self.client.wait(h) for _, _, h in self._pulls]
            staleness = [r.staleness for r in pushed]
            results = [r for r in pushed if r.kind == "push+pull"] + pulled
        except (PeerTimeout, PSError) as err:
            if not self.config.reconnect_s:
                raise
            self._pushes, self._pulls = [], []
            if self._forward is not None:
                self._forward.clear()
            self._bucket, self._bucket_names, self._bucket_dense, self._bucket_bytes = {}, [], [], 0
            self._reconnect(err)
            self._step += 1
            return {"comm_s": time.perf_counter() - start, "bytes_sent": 0, "bytes_recv": 0,
                    "staleness": [], "reconnected": 1}
        if self.trace is not None:
            for (name, sent_at, h), result in zip(pushes, pushed):  # a reply's time is when the client read it
                if result.kind == "push+pull":
                    self.trace(f"push+pull {name}", sent_at, h.done_at, thread="push",
                               waited_on_server_s=result.waited_s)
                else:
                    self.trace(f"push {name}", sent_at, h.done_at, thread="push")
            for (name, sent_at, h), result in zip(self._pulls, pulled):
                self.trace(f"pull {name}", sent_at, h.done_at, thread="pull", waited_on_server_s=result.waited_s)
        self._pushes, self._pulls = [], []
        if self.config.downpour:
            self._local_step()
        self._load({k: v for result in results for k, v in result.values.items()})
        for _, p in self._named:
            p.grad = None
        self._apply({k: v for result in results for k, v in result.grads.items()})
        if self.schedule is not None:  # no gradient left: changes nothing, but a scheduler on it
            self.schedule.step()       # sees the step it expects (else it warns of the wrong order)
        self._pushes_made += int(self._pushing())
        if self._watches_values:
            self._mark_values()
        self._step += 1
        if self.config.backup_workers:  # a dropped push: on at the shards' step
            self._step = max(self._step, min(self.client.versions.values()))
        late, coming = self._forward.handed_over() if self._forward is not None else (nothing_late(), 0)
        # When backward released each bucket (psar predict plays them).
        recorded = self._released and self._backward_s
        out_buckets = {"backward_s": self._backward_s, "buckets": self._released} if recorded else {}
        self._released, self._backward_s = [], 0.0
        out = {"comm_s": time.perf_counter() - start + late["forward_s"], **self._traffic(coming), **out_buckets,
               "wait_s": max([r.waited_s for r in results] + [waited, late["wait_s"]]),
               "staleness": late["staleness"] + staleness}
        if late["forward_s"]:  # this step's forward waited for the last step's values: not compute
            out["in_backward_s"] = late["forward_s"]
        if self.compressor is not None:  # pushes compressed, and pulled gradients decompressed
            out["compress_s"], self.compress_s = self.compress_s + self.client.codec_s, 0.0
            self.client.codec_s = 0.0
        return out

    def _traffic(self, coming: int = 0) -> dict[str, int]:
        """bytes_sent and bytes_recv since the last step ended (pushes leave during backward).
        Under ps.order=forward the pushes the window still holds and `coming` bytes of this
        step's values still on their way count here, not in the next step, which sends and
        reads them."""
        sent_now = self.client.bytes_sent + self.client.queued_bytes
        sent, received = sent_now - self._sent, self.client.bytes_recv - self._received + coming
        self._sent, self._received = sent_now, self.client.bytes_recv + coming
        return {"bytes_sent": sent, "bytes_recv": received}

    def _phase(self) -> float:
        """ps.exchange=phased: wait until every shard has finished the step, then pull the
        dense keys (rows come at lookup, as ever); the longest a shard held its answer back."""
        sent_at, asked = time.time(), self.client.step_done()
        for _, _, h in self._pushes:  # a refused push fails here, not after a wait's timeout
            self.client.wait(h)
        done = self.client.wait(asked)
        versions, waited = done.versions, done.waited_s
        if self.trace is not None:
            self.trace("wait for every shard's step", sent_at, asked.done_at, thread="pull")
        if self._dense_keys:
            self._pulls = [("dense keys", time.time(), self.client.pull(self._dense_keys, min_version=versions))]
        return waited

    def _reconnect(self, err: Exception) -> None:
        """A shard went away: wait (at most ps.reconnect_s) for it to come back from its
        checkpoint, join again, take its parameters, and count the updates it lost."""
        log.warning("%s; waiting up to %g s for the shards to come back", err, self.config.reconnect_s)
        before = dict(self.client.versions)
        self.client.abandon()
        deadline = time.monotonic() + self.config.reconnect_s
        while True:
            try:
                _, _, values = self.client.join()
                break
            except (PeerTimeout, PSError) as again:
                if time.monotonic() > deadline:
                    raise PSError(f"worker {self.rank}: the shards did not come back within "
                                  f"ps.reconnect_s={self.config.reconnect_s:g} s: {again}") from err
                time.sleep(self.config.heartbeat_s)
        self._load(values)
        if self._watches_values:
            self._mark_values()
        self._want = dict(self.client.versions)
        self._prefetched = {}  # abandoned with everything else in flight
        lost = max((before.get(s, 0) - v for s, v in self.client.versions.items()), default=0)
        self.updates_lost += max(0, lost)
        if self.mode != "sync":
            self._step = max(self.client.clocks.values(), default=0) - 1  # step() adds one
        log.warning("worker %d: rejoined at version %s; %d update(s) lost", self.rank,
                    dict(self.client.versions), max(0, lost))

    def close(self) -> None:
        """Rank 0 waits for every other worker to leave, then reads the final parameters and
        the servers' counters; every worker then leaves, which lets the servers end."""
        self.settle(counted=False)
        for hook in self._hooks + self._prehooks:
            hook.remove()
        for module in self._tables.values():
            module.sparse = False  # the model is handed back as it was built
        try:
            if self.rank == 0:
                final = self.client.wait_alive(self.client.pull(wait_left=True))
                self._load(final.values)
                self._server_stats = self.client.stats()
            self.client.leave()
        finally:
            self.client.close()

    @property
    def next_step(self) -> int:
        """The step this worker runs next: one more than the last, or under backup workers the
        shards' step, past the ones the others finished while this worker's push was late."""
        return self._step

    def report(self) -> dict:
        # How the shards held the model (ps.layout.Layout.cut): another psar may cut it otherwise.
        out = {"updates_lost": self.updates_lost,
               "layout": {"keys": len(self.layout.keys), "cut": self.layout.cut}}
        if self.config.backup_workers and self._server_stats:
            out["dropped_pushes"] = dropped_per_step(self._server_stats)
        if self._tables:
            out["row_pulls"] = dict(self.row_pulls)
        if self._server_stats:
            out["server_stats"] = self._server_stats
            kept = [s["memory"] for s in self._server_stats if isinstance(s.get("memory"), dict)]
            if kept:  # the most any shard held, by kind
                out["memory_bytes_per_shard"] = {k: max(m[k] for m in kept) for k in kept[0]}
        return out


def dropped_per_step(stats: list[dict]) -> list[int]:
    """For each step the shards finished, how many workers had a push of it dropped (on any
    shard: a worker counts once), from the shards' stats."""
    steps = min(st["version"] for st in stats)
    dropped: dict[int, set] = {}
    for st in stats:
        for step, workers in st.get("dropped", {}).items():
            dropped.setdefault(int(step), set()).update(workers)
    return [len(dropped.get(s, ())) for s in range(steps)]
