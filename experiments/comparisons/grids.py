"""Named comparisons: an experiment, the engines and worker counts to run it with, and the
settings that make the point. `psar compare NAME` runs one; its flags override the grid."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One line of a comparison: an engine with its shard count and settings."""

    engine: str
    servers: int | str = 1
    """Shards (ps-* engines): a count, or "N" for one per worker."""
    overrides: tuple[str, ...] = ()
    """`--set` overrides of this variant alone (after the comparison's)."""
    workers: tuple[int, ...] = ()
    """Its worker counts (): the comparison's."""

    def shards(self, workers: int) -> int:
        return workers if self.servers == "N" else int(self.servers)


@dataclass(frozen=True)
class Comparison:
    name: str
    """What `psar compare` is given."""
    experiment: str
    """The named experiment every run of the grid starts from."""
    engines: tuple[str, ...]
    """Engines compared (only the engine changes between runs)."""
    workers: tuple[int, ...]
    """Worker counts."""
    servers: tuple[int, ...] = (1,)
    """Server shard counts for the ps-* engines."""
    overrides: tuple[str, ...] = ()
    """`--set` overrides applied to every run (`--set` on the command line comes after)."""
    steps: int | None = None
    """Steps of every run (None: the experiment's); `--steps` on the command line wins."""
    variants: tuple[Variant, ...] = ()
    """Engines with their own shard counts and settings, in place of engines x servers
    (`--engines` and `--servers` then pick the variants' engines and counts)."""
    net: str = ""
    """The link rate the comparison is about (--net; the command line's wins); "": loopback."""
    claim: str = ""
    """The result the comparison reproduces, in one sentence."""
    rates: tuple[str, ...] = ()
    """Link rates every variant runs at, one grid after the other (--net gives one instead)."""
    report: str = ""
    """A report beside the table, the analysis module that makes it: "compression"
    (analysis.compression), "period" (analysis.period), "collectives" (analysis.collectives),
    "faults" (analysis.faults), "sharded" (analysis.sharded), "decentralized" (analysis.decentralized),
    "validation" (analysis.validation)."""
    prelude: str = ""
    """Measurements before the grid, the module of experiments.comparisons whose measure(out,
    echo) makes them in the output directory (the report reads them): "collectives",
    "machine"."""
    max_restarts: int | None = None
    """Every run's --max-restarts (None: a failure fails the run)."""

    def variants_at(self, net: str | None) -> tuple[Variant, ...]:
        """The variants, at every rate of `rates` unless a --net rate was given."""
        if not self.rates or net:
            return self.variants
        return tuple(Variant(v.engine, v.servers, v.overrides + (f"net.rate={rate}",), v.workers)
                     for rate in self.rates for v in self.variants)


def _compression_variants() -> tuple[Variant, ...]:
    """Every method on allreduce and ps-sync (one shard per worker, on the workers' hosts),
    and torch's own hooks under ddp; top-k and random-k at 1%."""
    settings = {"none": (), "fp16": (), "bf16": (), "topk": ("compress.ratio=0.01",),
                "randomk": ("compress.ratio=0.01",), "sign": (), "qsgd": (), "powersgd": ()}
    carried = {"allreduce": ("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "powersgd"),
               "ps-sync": ("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd"),
               "ddp": ("fp16", "powersgd")}
    return tuple(Variant(engine, "N" if engine == "ps-sync" else 1,
                         ((f"compress.method={m}",) if m != "none" else ()) + settings[m])
                 for engine, methods in carried.items() for m in methods)


FAULTS = {"none": (), "straggler": ("fault.slow_rank=3", "fault.slow_factor=3"),
          "pause": ("fault.pause_rank=3", "fault.pause_step=50", "fault.pause_s=10"),
          "kill": ("fault.kill_rank=3", "fault.kill_step=50")}
"""The faults comparison's scenarios: rank 3 of 4 is 3x slower, stops for 10 s once, or dies."""


def _fault_variants() -> tuple[Variant, ...]:
    """Every scenario on the ring and DDP (restart-all from the checkpoint of every 20 steps),
    ps-sync with and without a backup worker, ps-async and ps-ssp (the dead worker rejoins);
    one shard."""
    engines = (("allreduce", ()), ("ddp", ()), ("ps-sync", ()), ("ps-sync", ("ps.backup_workers=1",)),
               ("ps-async", ()), ("ps-ssp", ()))
    return tuple(Variant(engine, 1, extra + fault) for fault in FAULTS.values() for engine, extra in engines)


def _period_variants() -> tuple[Variant, ...]:
    """Periods 1, 4 and 16: local SGD on allreduce, Downpour on ps-sync and ps-async (a
    push of the summed gradients and a fetch every H steps), EASGD's tau; a shard per worker
    host for the parameter servers."""
    out = []
    for h in (1, 4, 16):
        out.append(Variant("allreduce", 1, (f"allreduce.period={h}",) if h > 1 else ()))
        for engine in ("ps-sync", "ps-async"):
            out.append(Variant(engine, "N", (f"ps.push_every={h}", f"ps.fetch_every={h}") if h > 1 else ()))
        out.append(Variant("ps-easgd", "N", (f"ps.easgd_tau={h}",)))
    return tuple(out)


DECENTRALIZED_NETWORKS = {"flat": (), "racks": ("net.racks=2", "net.uplink=50mbit"), "latency": ("net.latency_ms=20",),
                          "fast": ("net.rate=10gbit",)}
"""The decentralized comparison's networks: 100mbit flat; two racks of two workers behind
50mbit uplinks (4:1, the two hosts' 200mbit into 50); 20 ms of one-way latency on every link;
and a fast one, 10gbit."""


def _decentralized_variants() -> tuple[Variant, ...]:
    """The ring all-reduce (ring and auto), ps-sync with a shard on each worker's host, gossip
    on the ring and the one-peer exponential graph, AD-PSGD on the ring, and DiLoCo every 8
    steps, on each network."""
    engines = (Variant("allreduce", 1, ("allreduce.algorithm=ring",)),
               Variant("allreduce", 1, ("allreduce.algorithm=auto",)),
               Variant("ps-sync", "N", ("net.placement=colocated",)),
               Variant("gossip", 1, ("gossip.topology=ring",)),
               Variant("gossip", 1, ("gossip.topology=one-peer-exponential",)),
               Variant("gossip", 1, ("gossip.topology=ring", "gossip.mode=async")),
               Variant("allreduce", 1, ("allreduce.algorithm=ring", "allreduce.period=8", "allreduce.outer=nesterov")))
    return tuple(Variant(v.engine, v.servers, v.overrides + net)
                 for net in DECENTRALIZED_NETWORKS.values() for v in engines)


PREDICT_ENGINES = (Variant("allreduce"), Variant("ps-sync", "N", ("net.placement=separate",)),
                   Variant("ps-async", "N", ("net.placement=separate",)),
                   Variant("zero", 1, ("zero.stage=1", "zero.algorithm=ring")),
                   Variant("gossip", 1, ("gossip.topology=one-peer-exponential",)))
"""The engines `psar compare predict` checks psar predict on: the ring, the parameter server
with a shard host per worker (sync and async), ZeRO stage 1 on psar's ring, gossip on the
one-peer graph (zero on psar's ring takes the latency cell's delay at every hop, as the ring does)."""

PREDICT_HELD_OUT = {4: ("net.rate=100mbit", "net.rate=1gbit", "net.rate=2gbit",
                        "net.racks=2 net.uplink=100mbit", "net.latency_ms=10"),
                    8: ("net.rate=200mbit",)}
"""Held-out clusters by worker count: other rates, two racks behind 2:1 uplinks (two 200mbit
hosts into 100mbit), 10 ms of latency; and 8 workers at the calibration's rate."""


def _predict_variants() -> tuple[Variant, ...]:
    """Each engine at 2 workers on 200mbit (what psar predict calibrates on), then at 4 and 8
    workers on the held-out clusters."""
    calibration = tuple(Variant(v.engine, v.servers, v.overrides, (2,)) for v in PREDICT_ENGINES)
    held_out = tuple(Variant(v.engine, v.servers, v.overrides + tuple(net.split()), (n,))
                     for n, nets in PREDICT_HELD_OUT.items() for net in nets for v in PREDICT_ENGINES)
    return calibration + held_out


COMPARISONS: dict[str, Comparison] = {c.name: c for c in [
    Comparison(
        "sharded", "mlp-mid", ("ddp", "allreduce", "zero", "ps-sync"), (2, 4), steps=10, net="200mbit",
        overrides=("model.hidden=[512,512]", "optim.name=adamw", "optim.lr=0.001"), report="sharded",
        variants=(Variant("ddp"), Variant("allreduce"),
                  *(Variant("zero", 1, (f"zero.stage={k}", "zero.algorithm=ring")) for k in (1, 2, 3)),
                  Variant("ps-sync", "N", ("net.placement=colocated",))),
        claim="Memory is the third axis: ZeRO's stages keep 1/N of the optimizer state (1), of the "
              "gradients too (2) and of the parameters too (3), sending what the ring sends at "
              "stages 1 and 2 and half as much again at 3; a parameter server's co-located shards "
              "hold the state as stage 1 does, its workers none (zero on psar's ring halves: Gloo's own "
              "reduce-scatter and all-gather are slower than its all-reduce)."),
    Comparison(
        "decentralized", "mlp-mid", ("allreduce", "ps-sync", "gossip"), (4,), steps=40, net="100mbit",
        overrides=("model.hidden=[256,256]", "gossip.consensus_every=5"), variants=_decentralized_variants(),
        report="decentralized",
        claim="Decentralized SGD (Lian et al. 2017): each worker averages with its neighbours, so no "
              "step waits for every worker and a one-peer graph sends one model whatever N is; where "
              "the network is slow or its latency high it reaches the target sooner than the ring "
              "all-reduce and the parameter server, paying in models that drift apart (consensus "
              "distance); DiLoCo's outer step on local SGD communicates 8 times less."),
    Comparison(
        "predict", "mlp-mid", tuple(v.engine for v in PREDICT_ENGINES), (2, 4, 8), steps=30, net="200mbit",
        overrides=("model.hidden=[256,256]",), variants=_predict_variants(), prelude="machine",
        report="validation",
        claim="psar predict, checked on runs it was not calibrated on: from each engine's 2-worker run "
              "at 200mbit, its 4-worker runs at 100mbit, 1gbit and 2gbit, on two racks and with 10 ms "
              "of latency, and its 8-worker run, each link-bound one within 15%."),
    Comparison(
        "hogwild", "logreg-sparse", ("ps-async", "ps-sync", "allreduce"), (1, 2),
        claim="Hogwild!: on sparse logistic regression, lock-free asynchronous updates rarely "
              "collide, so async throughput grows with workers while the loss still falls."),
    Comparison(
        "straggler", "cnn", ("ps-async", "ps-ssp", "ps-sync", "allreduce"), (2,),
        overrides=("fault.slow_rank=1", "fault.slow_factor=4"), steps=60,
        claim="One worker 4x slower: sync and all-reduce wait for it every step, async does "
              "not, and ssp waits only when the gap exceeds its staleness bound."),
    Comparison(
        "link-scaling", "mlp-mid", ("allreduce", "ps-sync"), (2, 4), steps=8, net="200mbit",
        variants=(Variant("allreduce"), Variant("ps-sync", 1, ("net.placement=separate",)),
                  Variant("ps-sync", "N", ("net.placement=colocated",)),
                  Variant("ps-sync", "N", ("net.placement=colocated", "ps.exchange=phased"))),
        claim="On links of a fixed rate, the ring's bytes per link stay 2(N-1)/N of the gradient "
              "as N grows, one server shard's link carries N times it, and N shards co-located "
              "with the workers carry what the ring does; pulling only once every shard has "
              "finished (phased) keeps the replies off the links the pushes need."),
    Comparison(
        "spare-servers", "mlp-mid", ("allreduce", "ps-sync"), (4,), steps=8, net="200mbit",
        variants=(Variant("allreduce"),) + tuple(Variant("ps-sync", k, ("net.placement=separate",))
                                                  for k in (1, 2, 4)),
        claim="Spare CPU hosts as server shards: with k shards of their own, a shard's link carries "
              "N*M/k each way, so the step falls as k grows until the workers' own links bound it "
              "at k = N: M/B, pushes and pulls at once, below the ring's 2(N-1)/N*M/B (BytePS)."),
    Comparison(
        "sparse", "dlrm", ("ps-sync", "ps-async", "allreduce", "ddp"), (1, 2), steps=40,
        variants=(Variant("ps-sync"), Variant("ps-async"),
                  Variant("allreduce", overrides=("allreduce.sparse=dense",)),
                  Variant("allreduce", overrides=("allreduce.sparse=allgather",)), Variant("ddp")),
        claim="An embedding model (DLRM, 67 MB of tables, 128 examples a step): the parameter "
              "server pushes and pulls only the rows a batch touches and updates only those, "
              "all-reduce densifies every table every step; all-gathering the rows sits between."),
    Comparison(
        "compression", "mlp-mid", ("allreduce", "ps-sync", "ddp"), (2,), steps=40,
        overrides=("model.hidden=[512,512]",), variants=_compression_variants(), rates=("100mbit", "1gbit"),
        report="compression",
        claim="Compression pays where the link is slow: each method's bytes per step against the "
              "compute it adds, on a ring (all-reduce for messages that add up, all-gather else) and "
              "on a parameter server (decompressed and summed by the shards, pulls compressed back); "
              "above the rate where its saved link time equals its compute, it no longer pays."),
    Comparison(
        "period", "mlp-mid", ("allreduce", "ps-sync", "ps-async", "ps-easgd"), (2,), steps=64,
        overrides=("model.hidden=[512,512]",), variants=_period_variants(), net="100mbit", report="period",
        claim="How often to communicate: a worker that exchanges once every H steps pays the link "
              "once in H steps, so on a slow link the step falls towards its compute as H grows, "
              "and the loss pays for the models drifting apart in between (local SGD on the ring, "
              "Downpour and elastic averaging on the parameter server)."),
    Comparison(
        "collectives", "mlp-mid", ("allreduce", "ps-sync"), (4,), steps=6, net="200mbit",
        overrides=("net.racks=2", "net.uplink=100mbit"), prelude="collectives", report="collectives",
        variants=(Variant("allreduce", overrides=("allreduce.algorithm=ring",)),
                  Variant("allreduce", overrides=("allreduce.algorithm=hierarchical",)),
                  Variant("allreduce", overrides=("allreduce.algorithm=auto",)),
                  Variant("ps-sync", 2, ("net.placement=separate",)),
                  Variant("ps-sync", 2, ("net.placement=separate", "net.server_racks=0,0"))),
        claim="Which path: the ring's 2(N-1) steps lose to halving-doubling's and the tree's "
              "2 log2 N where each message pays a latency; on racks behind an oversubscribed "
              "uplink, a ring placed round-robin crosses it at every hop, hierarchical all-reduce "
              "with only 1/k of the tensor per host, and a parameter server's pushes and pulls "
              "with every shard outside the worker's rack."),
    Comparison(
        "faults", "cnn", ("allreduce", "ddp", "ps-sync", "ps-async", "ps-ssp"), (4,), steps=120, net="1gbit",
        overrides=("checkpoint.every=20", "target_loss=0.02"), variants=_fault_variants(), max_restarts=1,
        report="faults",
        claim="When one worker of four is 3x slower, stops for 10 s, or dies: the ring, DDP and ps-sync wait "
              "for it every step, a backup worker lets ps-sync go on with the first three, the asynchronous "
              "shards never wait (ssp within its bound); a dead all-reduce worker restarts every worker from "
              "the last checkpoint, losing the steps since, while a parameter-server worker rejoins alone."),
    Comparison(
        "comm-bound", "mlp-wide", ("ddp", "allreduce", "ps-sync", "ps-async"), (1, 2), (1, 2),
        steps=12,
        claim="80 MB of gradients per step: the ring moves 2(N-1)/N of them per link, a single "
              "server shard moves all of them for every worker, two shards halve that."),
]}


def get_comparison(name: str) -> Comparison | None:
    return COMPARISONS.get(name)
