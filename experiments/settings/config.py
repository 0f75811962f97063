"""The fully resolved configuration of one run: small frozen dataclasses, saved with every run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from allreduce.config import AllReduceConfig
from allreduce.gossip_config import GossipConfig
from allreduce.zero_config import ZeroConfig
from ps.config import WIRE_DTYPES, PSConfig, key_mb, sync_window

from experiments.workloads import data

from experiments.compression.config import CompressConfig
from experiments.rundir import files

from experiments.workloads import models
from experiments.rundir.checkpoint import CheckpointConfig
from experiments.engines import engines, get_engine
from experiments.settings.faults import FaultConfig
from experiments.settings.net import NetConfig, parse_rate
from experiments.settings.overrides import OverrideError, apply_overrides, dumps, from_dict

if TYPE_CHECKING:
    import torch

CASTS = ("fp16", "bf16")
"""The compress.method values that are the engines' own wire casts (allreduce.compression,
ps.compression)."""
DTYPES = ("float32", "float64")
"""The parameters' dtypes a run may have (torch's float32 and float64)."""
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer every engine runs: locally (all-reduce, ddp, local) or on the server (ps-*)."""

    name: str = "sgd"
    """'sgd' (with optional momentum), 'adam', 'adamw' or 'adagrad'."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adam", "adamw", "adagrad"):
            raise ValueError(f"optim.name={self.name!r}: expected sgd, adam, adamw or adagrad")
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr}: must be > 0")

    def build(self, params) -> torch.optim.Optimizer:
        import torch

        params = list(params)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay)
        if self.name == "adagrad":  # a row with no gradient is left as it is, as in a sparse update
            return torch.optim.Adagrad(params, lr=self.lr, weight_decay=self.weight_decay)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=(self.beta1, self.beta2),
                   weight_decay=self.weight_decay)


@dataclass(frozen=True)
class RunConfig:
    """One run: experiment, engine, and everything the workers need to repeat it."""

    experiment: str
    """Name of the preset this run started from."""
    model: Any
    """Model section (an experiments.workloads.models config)."""
    data: Any
    """Data section (an experiments.workloads.data config)."""
    steps: int = 100
    """Optimizer steps per worker."""
    batch_size: int = 32
    """Examples per worker per step (the global batch is workers x batch_size)."""
    engine: str = "allreduce"
    """Gradient synchronisation: an engine of `psar list` (local, ddp, allreduce, ps-sync,
    ps-async, ps-ssp, and any in $PSAR_ENGINES)."""
    workers: int = 2
    """Number of workers (data shards)."""
    servers: int = 1
    """Parameter-server shards (ps-* engines)."""
    seed: int = 0
    """Seeds the model's initial weights, the data and the shards' order."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32 or float64."""
    device: str = "cpu"
    """'cpu' (Gloo) or 'cuda' (NCCL)."""
    threads: int = 0
    """Torch intra-op threads per process; 0: each takes its share of its host's cores, a worker
    among the ranks on its host, a shard among the ranks and shards launched there (alone on its
    host, as `psar server` runs it, all of them, and as many ZeroMQ I/O threads as it has
    workers, at most 4: ps/cores.py). A shard (with sgd, adam, adamw or adagrad) spends its share on
    threads of its own for large keys and keeps torch on one (ps/shard/slices.py; sgd's compiled
    kernel splits a key of 3 MiB or more over threads of its own, ps/shard/_split.h)."""
    timeout_s: float = 30.0
    """Longest wait on any peer (rendezvous, collective) before the run fails."""
    eval_batch_size: int = 512
    """Batch size of the final evaluation on the test split."""
    target_loss: float = 0.0
    """Time to target: the comparison table gives the steps and seconds until the training
    loss (mean over workers, over the last 5 steps) first reaches this; 0: none."""
    trace: bool = False
    """Write a Chrome trace (trace.json) of every process's forward, backward and messages."""
    tensorboard: bool = False
    """Write TensorBoard event files as the run trains (RUN_DIR/tensorboard/; needs the
    tensorboard extra)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer section."""
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    """All-reduce engine section."""
    ps: PSConfig = field(default_factory=PSConfig)
    """Parameter-server section."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """Sharded data-parallel (ZeRO) section."""
    gossip: GossipConfig = field(default_factory=GossipConfig)
    """Decentralized (gossip) section."""
    compress: CompressConfig = field(default_factory=CompressConfig)
    """Gradient compression, one setting for every engine. compress.method=fp16 or bf16 sets
    allreduce.compression (allreduce, ddp) and ps.compression (ps-*) alike, which remain as
    each family's own name for it; powersgd runs on ddp (torch's own powerSGD_hook) and
    allreduce, topk, randomk, sign and qsgd on allreduce and the ps-* engines.
    `psar list` and docs/engines.md say which engine carries which method."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Injected faults (a slow worker, a slow link)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints (checkpoint.every=K), for --resume."""
    net: NetConfig = field(default_factory=NetConfig)
    """An emulated cluster: a host per worker (and per separate shard), shaped links (--net)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "workers", "servers", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: expected cpu or cuda")
        if self.threads < 0 or not self.timeout_s > 0:
            raise ValueError(f"threads={self.threads} must be >= 0 and timeout_s={self.timeout_s} > 0")
        self._alias_compression()

    def check(self) -> None:
        """The checks of settings against each other that wait until every override is in
        (they come one at a time, in any order): compression, pulls, local SGD, Downpour, and
        the emulated network's racks against the hosts."""
        self.compress.check()
        self.check_pulls()
        self.check_period()
        self.check_downpour()
        self.check_backups()
        spec = get_engine(self.engine)
        self.net.check(self.workers if spec.processes_per_worker else 1,
                       self.servers if spec.uses_servers and self.net.placement == "separate" else None)

    def check_period(self) -> None:
        """Local SGD's settings against the run's other settings (after every override)."""
        section = self.allreduce
        if not get_engine(self.engine).reads_setting("allreduce.period") or section.period == 1:
            if section.period_warmup and get_engine(self.engine).reads_setting("allreduce.period_warmup"):
                raise ValueError(f"allreduce.period_warmup={section.period_warmup}: a warm-up before local SGD "
                                 "needs allreduce.period > 1")
            if section.outer != "none" and get_engine(self.engine).reads_setting("allreduce.outer"):
                raise ValueError(f"allreduce.outer={section.outer}: an outer step (DiLoCo) needs local SGD, "
                                 "allreduce.period > 1")
            return
        if section.period_warmup >= self.steps and not isinstance(self.model, ScriptConfig):
            raise ValueError(f"allreduce.period_warmup={section.period_warmup} is not shorter than the run "
                             f"({self.steps} steps): local SGD would never start")
        if self.compress.method != "none" or section.compression != "none":
            raise ValueError(f"allreduce.period={section.period} with compression: local SGD averages the "
                             "parameters uncompressed; choose one")
        if section.sparse == "allgather":
            raise ValueError(f"allreduce.period={section.period} with allreduce.sparse=allgather: the tables' "
                             "rows are gathered every step; local SGD averages whole parameters")
        if self.checkpoint.every:
            raise ValueError(f"allreduce.period={section.period} with checkpoint.every: between averagings "
                             "the workers' models differ, and a checkpoint keeps rank 0's")

    def check_downpour(self) -> None:
        """Downpour's settings against the run's (after every override)."""
        ps, spec = self.ps, get_engine(self.engine)
        if not ps.downpour or not spec.reads_setting("ps.push_every"):
            return
        ps.check_downpour(self.engine, spec.consistency == "sync", self.compress.method)
        if self.checkpoint.every:
            raise ValueError("ps.push_every/ps.fetch_every above 1 with checkpoint.every: a worker's own steps "
                             "and unpushed gradients are not in the shards' checkpoints")

    def check_backups(self) -> None:
        """Backup workers against the run's other settings (after every override)."""
        b, spec = self.ps.backup_workers, get_engine(self.engine)
        if not b or not spec.reads_setting("ps.backup_workers"):
            return
        if b >= self.workers:
            raise ValueError(f"ps.backup_workers={b} with {self.workers} workers: a step needs at least one "
                             "worker's push (at most workers - 1 backups)")
        if self.ps.downpour:
            raise ValueError(f"ps.backup_workers={b} with ps.push_every/ps.fetch_every above 1: one at a time")
        if self.carries_compressor() and self.compress.pull:
            raise ValueError(f"ps.backup_workers={b} with compress.method={self.compress.method} and "
                             "compress.pull: each worker applies every update's gradient itself, and one "
                             "whose push came late would skip some; set compress.pull=false")

    def check_pulls(self) -> None:
        """Compressed pulls leave each worker's optimizer to step on its own; a worker that
        rejoins restarted shards would not get its state back (after every override)."""
        method = self.compress.method
        if self.carries_compressor() and get_engine(self.engine).reads_setting("compress.pull") \
                and self.compress.pull and self.ps.reconnect_s:
            raise ValueError(f"compress.method={method} with ps.reconnect_s={self.ps.reconnect_s:g}: under "
                             "compressed pulls each worker steps its own optimizer, whose state a worker "
                             "that rejoins restarted shards cannot get back; set compress.pull=false")

    def _alias_compression(self) -> None:
        """compress.method's casts set the engines' own compression settings, which must agree;
        a method the engine does not carry is refused, naming the engines that do."""
        method, spec = self.compress.method, get_engine(self.engine)
        if method == "none":
            return
        if spec.reads_setting("compress.method") and method not in spec.compressions:
            carriers = [name for name, other in engines().items()
                        if other.reads_setting("compress.method") and method in other.compressions]
            raise ValueError(f"compress.method={method}: engine {self.engine} carries "
                             f"{', '.join(spec.compressions)}; "
                             + (f"{method} runs on {', '.join(carriers)}" if carriers else
                                f"no engine carries {method} yet"))
        if method not in CASTS:
            wires = [f"{name}.compression={getattr(self, name).compression}" for name in ("allreduce", "ps")
                     if getattr(self, name).compression != "none"]
            if wires:
                raise ValueError(f"compress.method={method} and {', '.join(wires)}: give one compression")
            if method == "powersgd" and self.compress.start_step <= 1:  # torch's PowerSGDState refuses it
                raise ValueError(f"compress.start_step={self.compress.start_step}: PowerSGD with error "
                                 "feedback or warm start needs it > 1 (torch's start_powerSGD_iter)")
            return
        if self.compress.error_feedback:
            raise ValueError(f"compress.error_feedback=true: the engines send compress.method={method} "
                             "without error feedback")
        for name in ("allreduce", "ps"):
            section = getattr(self, name)
            if section.compression not in ("none", method):
                raise ValueError(f"compress.method={method} and {name}.compression={section.compression} "
                                 f"disagree: give one (compress.method sets both engine families)")
            object.__setattr__(self, name, replace(section, compression=method))

    def sparse_tables(self, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """{name: module} of the embedding tables this run's engine moves row-sparse (none for
        local and ddp, which stay dense as the reference). ValueError when row-sparse is asked
        for, the model has tables, and the optimizer's sparse update is not its dense one."""
        from experiments.workloads.sparsity import embedding_tables, sparse_update_problem

        problem = sparse_update_problem(self.optim)
        decide = get_engine(self.engine).row_sparse
        forced, on = decide(self, problem) if decide else ("", False)
        tables = embedding_tables(model) if on else {}
        if tables and problem:
            raise ValueError(f"{forced}: {problem}")
        return tables

    def worker_ps(self) -> PSConfig:
        """ps as a worker runs it: under ps-sync, with the window and buckets of
        ps.config.sync_window for its keys and links (net.rate)."""
        if get_engine(self.engine).consistency != "sync":
            return self.ps
        window, bucket = sync_window(self.ps.window_mb, self.ps.bucket_kb, self.key_mb(),
                                     parse_rate(self.net.rate) if self.net.rate else None, self.ps.order)
        return replace(self.ps, window_mb=window, bucket_kb=bucket)

    def key_mb(self) -> float:
        """The parameter server's key size in MiB: ps.chunk_mb, or where that is 0 by net.rate
        and the bytes a key's messages carry (wire_share): about ps.config.KEY_MS of link each.
        mlp-mid ps-sync x2 with top-k 1% at 100mbit, 60 steps: 61.7 ms a step with the 0.125
        MiB keys the dense bytes gave, 36.5 with 0.5 MiB, 34.8 with 4 MiB (each key's codec
        calls and checks, once a key, on two cores shared by two workers and two shards)."""
        rate = parse_rate(self.net.rate) if self.net.rate else None
        return key_mb(self.ps.chunk_mb, rate / self.wire_share() if rate and not self.ps.chunk_mb else rate)

    def carries_compressor(self) -> bool:
        """Whether compress.method is a compressor the engines carry themselves: neither none
        nor a cast (the casts set the engines' own wire dtypes)."""
        return self.compress.method not in ("none", *CASTS)

    def compresses_pulls(self) -> bool:
        """Whether the shards send pulls as compressed changes (ps-sync, compress.pull)."""
        return self.carries_compressor() and self.compress.pull and get_engine(self.engine).consistency == "sync"

    def wire_share(self) -> float:
        """The bytes of a key's busier message, a push or its pull's reply, over the key's own
        bytes: 1 uncompressed, a wire cast's itemsize over the parameters' (ps.compression,
        both ways), a compressor's (compress.method) as its message of a probe of 65,536
        entries (pushes; pulls too under ps-sync with compress.pull, else the values whole)."""
        import torch

        from experiments.compression.base import Context

        dtype = self.torch_dtype
        wire = WIRE_DTYPES.get(self.ps.compression)
        if wire is not None:
            return getattr(torch, wire).itemsize / dtype.itemsize
        if not self.compresses_pulls():
            return 1.0
        probe = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).to(dtype)
        frames = self.compress.build()[0].compress(probe, Context()).frames
        return min(1.0, sum(f.numel() * f.element_size() for f in frames) / (probe.numel() * dtype.itemsize))

    def sparse_key_mb(self) -> float:
        """The key size in MiB of the tables moved by rows: ps.chunk_mb, or where that is 0 the
        largest key, whatever the link. A message carries only the rows a batch touches, so
        smaller keys only add keys to it, each with its frames and checks: dlrm x2 at 200mbit
        took 0.18 to 0.24 s a step with keys of 1/8 MiB, 0.065 s with 0.5 MiB, 0.015 s with
        4 MiB."""
        return key_mb(self.ps.chunk_mb)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ScriptConfig:
    """The model and data sections of a script run: the script and its arguments."""

    path: str = ""
    """The script, as given to `psar launch`."""
    args: tuple[str, ...] = ()
    """Its command-line arguments."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))  # JSON gives a list

    def build(self, *_: Any) -> Any:
        raise ValueError(f"a script run's model and data are built by the script ({self.path}), not by psar")


def _section_types() -> dict[str, type]:
    classes = [RunConfig, OptimConfig, AllReduceConfig, ZeroConfig, GossipConfig, PSConfig, FaultConfig, CheckpointConfig, NetConfig,
               CompressConfig, ScriptConfig]
    classes += [getattr(models, n) for n in dir(models) if n.endswith("Config")]
    classes += [getattr(data, n) for n in dir(data) if n.endswith("Config")]
    return {c.__name__: c for c in classes if isinstance(c, type)}


def save(config: RunConfig, path: Path) -> None:
    """Write config.json atomically: every process of a run may write it, others read it."""
    files.write_text(path, dumps(config) + "\n")


def load(path: Path, timeout_s: float = 0.0) -> RunConfig:
    """Read config.json; timeout_s: wait that long for it to appear (another process writes it)."""
    try:
        raw = files.read_json(path, timeout_s, what="config")
    except (OSError, ValueError) as err:
        raise OverrideError(f"cannot read config: {err}") from None
    if not isinstance(raw, dict):
        raise OverrideError(f"config {path} is not a JSON object")
    try:
        return from_dict(RunConfig, raw, _section_types())
    except TypeError as err:
        raise OverrideError(f"config {path}: {err}") from None


def resolve(base: RunConfig, overrides=(), **fields) -> RunConfig:
    """Apply CLI fields (engine, workers, ...) then `--set` overrides, strictly."""
    import dataclasses

    try:
        config = dataclasses.replace(base, **{k: v for k, v in fields.items() if v is not None})
        config = apply_overrides(config, overrides)
        check = getattr(config.model, "check_data", None)  # after every override: they come one by one
        if check is not None:
            check(config.data)
        config.check()
        return config
    except (TypeError, ValueError) as err:
        raise OverrideError(str(err)) from None
