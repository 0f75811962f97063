"""The engine protocol the training loop is written against, and the one registry of engines.

The loop never asks which engine it runs; an engine satisfies this protocol by shape. Every
other module (the CLI, the settings checks, the tables, the figures, the cost and link
models) asks the registry what an engine is, and never lists engine names. This module
imports no torch, so that analysis can read it.

Adding an engine is one step: `register(EngineSpec(...))` in any module, named in
$PSAR_ENGINES (comma-separated modules) when it is not one of psar's own, so that every
process of a run (workers, shards, the analysis) imports it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

MakeOptimizer = Callable[[list["torch.nn.Parameter"]], "torch.optim.Optimizer"]
Trace = Callable[..., None]
PLUGINS_ENV = "PSAR_ENGINES"
FAMILIES = ("local", "ring", "ps", "sharded", "gossip")


class Engine(Protocol):
    shards: Sequence[int]
    """The data shards this process trains on each step: [rank], or all of them for `local`."""

    def attach(self, model: "torch.nn.Module", make_optimizer: MakeOptimizer) -> "torch.nn.Module":
        """Agree on initial parameters, install hooks; return the module to call forward on."""

    def backward(self, loss: "torch.Tensor") -> None:
        """Run backward for one shard's loss; communication may start inside it."""

    def step(self) -> Mapping[str, float]:
        """Finish communication and update parameters; return this step's metrics
        (comm_s, bytes_sent, bytes_recv, and engine-specific ones such as staleness)."""

    def close(self) -> None:
        """Leave the job once every worker is done."""

    def report(self) -> Mapping:
        """After close: anything the run's summary should keep (e.g. the servers' counters)."""


@dataclass(frozen=True)
class Label:
    """A name runs are told apart by in tables and figures: an engine's, or a variant's."""

    name: str
    colour: str
    """Its colour in every figure."""
    fit: str = ""
    """The cost model's bench fit of its communication ("library", "ring", "ps"); "" takes
    its family's ("library" for ring, "ps" for ps)."""
    gathers_rows: bool = False
    """Its embedding rows travel in an all-gather besides the dense all-reduce (the link model
    adds them; its compute is not the dense engines')."""


@dataclass(frozen=True)
class EngineSpec:
    name: str
    summary: str
    build: str
    """"module:function" making the engine from (cfg, env, device, trace), imported when a
    run builds one; trace is a tracer's record function when the run is traced, else None."""
    family: str
    """How its workers communicate, which the cost and link models price: "local" (not at
    all), "ring" (an all-reduce of the gradient), "ps" (push to and pull from shards) or
    "sharded" (a reduce-scatter of the gradient to its owners, an all-gather of the values) or
    "gossip" (each worker's model to its neighbours on a graph)."""
    colour: str
    """The colour of its label in every figure."""
    processes_per_worker: bool = True
    """False when one process plays every worker (local)."""
    uses_servers: bool = False
    """It runs parameter-server shards (`--servers`, `net.placement`)."""
    consistency: str = ""
    """Its shards' rule (ps.protocol.MODES: sync, async, ssp); "" without shards."""
    synchronous: bool = True
    """Every worker applies the same update each step, so a fast worker waits for the slowest."""
    comm_in_backward: bool = False
    """Its communication runs inside backward where psar cannot time it apart (torch's DDP):
    its step_s - comm_s is not its compute."""
    reads: tuple[str, ...] = ()
    """The engine-specific settings it reads (keys, or prefixes ending in "."); a setting no
    engine lists here is read by every engine."""
    skips: tuple[str, ...] = ()
    """Settings under `reads`' prefixes that it does not read."""
    own: tuple[str, ...] = ()
    """Settings among those it reads that each process may choose for itself; the others
    every process of a run must agree on (experiments.settings.agreement)."""
    compressions: tuple[str, ...] = ("none", "fp16", "bf16")
    """The compress.method values it carries (where it reads compress.method)."""
    row_sparse: Callable[[Any, str | None], tuple[str, bool]] | None = None
    """(cfg, why the optimizer cannot update rows sparsely or None) -> (the setting that asks
    for row-sparse tables, whether cfg moves them row-sparse); None: always dense."""
    variants: tuple[Label, ...] = ()
    """Labels of its variants, when a setting tells its runs apart (see label_of)."""
    label_of: Callable[[Mapping], str] | None = None
    """A run's label from its config (as config.json holds it); None: the engine's name."""

    @property
    def rendezvous(self) -> bool:
        """Its workers meet through torch.distributed's env:// rendezvous (MASTER_ADDR/PORT)."""
        return self.processes_per_worker and not self.uses_servers

    @property
    def labels(self) -> tuple[Label, ...]:
        """Every label its runs can have."""
        return self.variants or (Label(self.name, self.colour),)

    def label(self, config: Mapping) -> str:
        return self.label_of(config) if self.label_of else self.name

    def reads_setting(self, key: str) -> bool:
        return matches(key, self.reads) and not matches(key, self.skips)

    def make(self, cfg: Any, env: Any, device: "torch.device", trace: Trace | None) -> Engine:
        """The engine for cfg (a RunConfig) as the process env (a DistEnv) plays its part."""
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)(cfg, env, device, trace)


def matches(key: str, names: Sequence[str]) -> bool:
    """Whether setting `key` is one of `names` (keys, or prefixes ending in ".")."""
    return any(key.startswith(n) if n.endswith(".") else key == n for n in names)


# -------------------------------------------------------------------------- the registry

_ENGINES: dict[str, EngineSpec] = {}
_plugins_loaded = False


def register(spec: EngineSpec) -> EngineSpec:
    """Add an engine; its name and labels must be new (a module imported again under another
    name may register its engine again: same name, same build). Returns spec."""
    if spec.family not in FAMILIES:
        raise ValueError(f"engine {spec.name!r}: family {spec.family!r}, expected one of {', '.join(FAMILIES)}")
    if spec.name in _ENGINES and _ENGINES[spec.name].build != spec.build:
        raise ValueError(f"engine {spec.name!r} is already registered (built by {_ENGINES[spec.name].build})")
    taken = {label.name for name, other in _ENGINES.items() if name != spec.name for label in other.labels}
    clash = [label.name for label in spec.labels if label.name in taken]
    if clash:
        raise ValueError(f"engine {spec.name!r}: label(s) {', '.join(clash)} already belong to another engine")
    _ENGINES[spec.name] = spec
    return spec


def engines() -> dict[str, EngineSpec]:
    """Every engine by name, psar's own first, then those of the modules in $PSAR_ENGINES."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ValueError(f"{PLUGINS_ENV} names module {module!r}, which cannot be imported: {err}") from None
    return _ENGINES


def get_engine(name: str) -> EngineSpec:
    known = engines()
    if name not in known:
        raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(known)} "
                         f"(an engine of your own: name its module in ${PLUGINS_ENV})")
    return known[name]


def label_info(label: str) -> tuple[EngineSpec, Label]:
    """The engine a run label belongs to, and the label's properties; an engine's name stands
    for its first label ("allreduce": "allreduce/library")."""
    if label in engines():
        spec = engines()[label]
        return spec, spec.labels[0]
    for spec in engines().values():
        for info in spec.labels:
            if info.name == label:
                return spec, info
    known = [info.name for spec in engines().values() for info in spec.labels]
    raise ValueError(f"unknown engine label {label!r}: expected one of {', '.join(known)}")


def all_labels() -> tuple[str, ...]:
    """Every label any registered engine's runs can have."""
    return tuple(info.name for spec in engines().values() for info in spec.labels)


# -------------------------------------------------------------------------- psar's engines

def _allreduce_label(config: Mapping) -> str:
    settings = config.get("allreduce") or {}
    label = f"allreduce/{settings.get('algorithm', 'library')}"
    return label + "+allgather" if settings.get("sparse") == "allgather" else label


def _zero_label(config: Mapping) -> str:
    return f"zero-{(config.get('zero') or {}).get('stage', 1)}"


def _gossip_label(config: Mapping) -> str:
    return f"gossip/{(config.get('gossip') or {}).get('topology', 'ring')}"


def _ps_sync_label(config: Mapping) -> str:
    return "ps-sync+backup" if (config.get("ps") or {}).get("backup_workers") else "ps-sync"


def _allreduce_rows(cfg: Any, problem: str | None) -> tuple[str, bool]:
    return "allreduce.sparse=allgather", cfg.allreduce.sparse == "allgather"


def _ps_rows(cfg: Any, problem: str | None) -> tuple[str, bool]:
    return "ps.sparse=rows", cfg.ps.sparse == "rows" or (cfg.ps.sparse == "auto" and not problem)


_PS_OWN = ("ps.curve_dir", "ps.curve_name", "ps.timeout_s", "ps.heartbeat_s", "ps.worker_timeout_s",
           "ps.reconnect_s", "ps.max_message_mb", "ps.bucket_kb", "ps.window_mb", "ps.order")
_PS_READS = ("ps.", "compress.method", "compress.ratio", "compress.levels", "compress.seed",
             "compress.error_feedback", "compress.pull", "servers", "fault.delay_ms")
_PS_COMPRESSIONS = ("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd")
_EASGD = ("ps.easgd_alpha", "ps.easgd_tau")
_SYNC_ONLY = ("ps.backup_workers",)

for _spec in [
    EngineSpec("local", "one process accumulates every shard's gradient: the reference",
               "experiments.harness.builders:local", "local", "#7f7f7f",  # grey: the numerical reference
               processes_per_worker=False),
    EngineSpec("ddp", "torch DistributedDataParallel", "experiments.harness.builders:ddp", "ring", "#8c564b",
               comm_in_backward=True, compressions=("none", "fp16", "bf16", "powersgd"),  # torch's own hooks
               reads=("allreduce.bucket_cap_mb", "allreduce.compression", "allreduce.period", "allreduce.period_warmup",
                      "compress.method", "compress.rank",
                      "compress.start_step", "compress.error_feedback", "compress.seed")),
    EngineSpec("allreduce", "bucketed all-reduce from gradient hooks (library or ring)",
               "experiments.harness.builders:allreduce", "ring", "#1f77b4",
               compressions=("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "powersgd"),
               reads=("allreduce.", "compress.", "fault.delay_ms"), skips=("compress.pull",),
               row_sparse=_allreduce_rows, label_of=_allreduce_label,
               variants=(Label("allreduce/library", "#1f77b4", "library"),          # blue
                         Label("allreduce/ring", "#17becf", "ring"),                # cyan
                         Label("allreduce/library+allgather", "#9467bd", "library", gathers_rows=True),
                         Label("allreduce/ring+allgather", "#c5b0d5", "ring", gathers_rows=True),
                         Label("allreduce/halving-doubling", "#393b79", "ring"),    # dark blue
                         Label("allreduce/halving-doubling+allgather", "#6b6ecf", "ring", gathers_rows=True),
                         Label("allreduce/tree", "#8c6d31", "ring"),                # brown-olive
                         Label("allreduce/tree+allgather", "#bd9e39", "ring", gathers_rows=True),
                         Label("allreduce/hierarchical", "#843c39", "ring"),        # dark red-brown
                         Label("allreduce/hierarchical+allgather", "#ad494a", "ring", gathers_rows=True),
                         Label("allreduce/auto", "#5254a3", "ring"),
                         Label("allreduce/auto+allgather", "#9c9ede", "ring", gathers_rows=True))),
    EngineSpec("zero", "ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the workers",
               "experiments.harness.builders:zero", "sharded", "#a55194", reads=("zero.", "fault.delay_ms"),
               label_of=_zero_label, compressions=("none",),
               variants=(Label("zero-1", "#a55194", "library"),                   # purple-pink
                         Label("zero-2", "#7b4173", "library"),                   # plum
                         Label("zero-3", "#ce6dbd", "library"))),                 # orchid
    EngineSpec("gossip", "decentralized SGD (D-PSGD): each worker averages its model with its neighbours on a graph",
               "experiments.harness.builders:gossip", "gossip", "#e6550d", reads=("gossip.",),
               label_of=_gossip_label, compressions=("none",),
               variants=(Label("gossip/ring", "#e6550d"),                        # dark orange
                         Label("gossip/torus", "#fd8d3c"),                       # orange
                         Label("gossip/exponential", "#fdae6b"),                 # light orange
                         Label("gossip/one-peer-exponential", "#a63603"),        # rust
                         Label("gossip/complete", "#fdd0a2"))),                  # peach
    EngineSpec("ps-sync", "parameter server, bulk synchronous: one averaged update per step",
               "experiments.harness.builders:ps", "ps", "#2ca02c", uses_servers=True, consistency="sync",
               reads=_PS_READS, skips=("ps.staleness", "ps.async_scale") + _EASGD, own=_PS_OWN, row_sparse=_ps_rows,
               compressions=_PS_COMPRESSIONS, label_of=_ps_sync_label,
               variants=(Label("ps-sync", "#2ca02c"),                            # green
                         Label("ps-sync+backup", "#006d2c"))),                    # dark green
    EngineSpec("ps-async", "parameter server, Hogwild-style: every push applied on arrival",
               "experiments.harness.builders:ps", "ps", "#d62728", uses_servers=True, consistency="async",
               synchronous=False, reads=_PS_READS, skips=("ps.staleness", "ps.window_mb", "ps.order", "ps.exchange",
                                                          "compress.pull") + _EASGD + _SYNC_ONLY,
               own=_PS_OWN, row_sparse=_ps_rows, compressions=_PS_COMPRESSIONS),
    EngineSpec("ps-ssp", "parameter server, stale synchronous: at most ps.staleness clocks ahead",
               "experiments.harness.builders:ps", "ps", "#ff7f0e", uses_servers=True, consistency="ssp",
               synchronous=False, reads=_PS_READS,
               skips=("ps.window_mb", "ps.order", "ps.exchange", "compress.pull") + _EASGD + _SYNC_ONLY,
               own=_PS_OWN, row_sparse=_ps_rows, compressions=_PS_COMPRESSIONS),
    EngineSpec("ps-easgd", "parameter server, elastic averaging: each worker's model tied to a centre on the shards",
               "experiments.harness.builders:ps", "ps", "#637939", uses_servers=True, consistency="async",
               synchronous=False, reads=("ps.", "compress.method", "servers", "fault.delay_ms"),
               skips=("ps.staleness", "ps.window_mb", "ps.order", "ps.exchange", "ps.async_scale", "ps.push_every",
                      "ps.fetch_every", "ps.bucket_kb") + _SYNC_ONLY,
               own=_PS_OWN, row_sparse=_ps_rows, compressions=("none", "fp16", "bf16")),  # its elastic moves cast
]:
    register(_spec)
