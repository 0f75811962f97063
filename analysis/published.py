"""Published scaling results, encoded with their sources and stated inputs, for `psar predict
--published` to print beside psar's prediction of the same setting.

Each encoded result names what its sources state: the model's parameters (fp32 bytes), the
compute of one step on one GPU (its batch over the single-GPU throughput the cited benchmark
reports), the servers, the GPUs on each and their links. psar fits nothing to them: the
prediction is the ideal exchange (analysis/predict.py's schedules, no calibration) over the
servers' links, and the scaling efficiency is one GPU's compute over compute plus exchange.
Two things psar does not price are named where they matter: GPUs within a server reduce
over PCIe or NVLink (the ring is played over the servers' links, which NCCL's ring crosses
once per server), and an engine that overlaps its exchange with backward (Horovod's tensor
fusion) hides part of it, which psar's step (compute plus exchange) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

HOROVOD = "Horovod's benchmarks page (docs/benchmarks.rst) and README"
HOROVOD_2017 = "Horovod's README of 2017 (the benchmark on 32 servers)"
TF_P100 = ("TensorFlow's performance benchmarks (tensorflow.org/performance/benchmarks, May 2017): "
           "one P100 of a DGX-1, synthetic data, batch 64")
KERAS = "Keras Applications' table of models (parameters with the top layers)"


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    engine: str
    """psar's label for the engine the result measured."""
    servers: int
    gpus_per_server: int
    rate_bits: float
    """Each server's link, bits/s."""
    params: int
    compute_s: float
    """One step on one GPU: its batch over one GPU's images/s."""
    inputs: str
    """Where params and compute_s come from."""
    figure: float
    """The published scaling efficiency (throughput over GPUs x one GPU's)."""


@dataclass(frozen=True)
class NotEncoded:
    name: str
    source: str
    why: str


RESULTS = (
    Published("Horovod, Inception V3, 512 P100 (128 servers x 4), 25 Gbit/s RoCE", HOROVOD, "allreduce/ring",
              128, 4, 25e9, 23_851_784, 64 / 142, f"{KERAS}; {TF_P100}: 142 images/s", 0.90),
    Published("Horovod, VGG-16, 512 P100 (128 servers x 4), 25 Gbit/s RoCE", HOROVOD, "allreduce/ring",
              128, 4, 25e9, 138_357_544, 64 / 154, f"{KERAS}; {TF_P100}: 154 images/s", 0.68),
    Published("Horovod, Inception V3, 128 P100 (32 servers x 4), 25 Gbit/s RoCE", HOROVOD_2017, "allreduce/ring",
              32, 4, 25e9, 23_851_784, 64 / 142, f"{KERAS}; {TF_P100}: 142 images/s", 0.90),
    Published("Horovod, VGG-16, 128 P100 (32 servers x 4), 25 Gbit/s RoCE", HOROVOD_2017, "allreduce/ring",
              32, 4, 25e9, 138_357_544, 64 / 154, f"{KERAS}; {TF_P100}: 154 images/s", 0.79),
)

NOT_ENCODED = (
    NotEncoded("Horovod, ResNet-101, 512 and 128 P100: 90%", HOROVOD,
               "no single-P100 throughput of ResNet-101 in the cited benchmarks (they give ResNet-50 and -152), "
               "and psar will not interpolate one"),
    NotEncoded("BytePS against Horovod, VGG-16 +100% and ResNet-50 +44%, 8 V100 per VM, 20 Gbit/s TCP",
               "BytePS's README and docs/performance.md",
               "the number of machines appears only in plots, and no V100 throughput at batch 64 is stated"),
    NotEncoded("BytePS, OSDI'20: speed-ups against the number of CPU machines", "Jiang et al., OSDI 2020",
               "the figures are plots; their values and each model's compute per step are not stated in text"),
    NotEncoded("PyTorch DDP, VLDB'20: ResNet-50 and BERT up to 256 GPUs", "Li et al., VLDB 2020",
               "the scaling is given in plots, with no per-GPU compute stated"),
)


BACKWARD_SHARE = 2 / 3
"""Backward's share of a step's compute (its FLOPs are about twice the forward's): the most of
it an exchange overlapped with backward can hide behind."""


def rows() -> list[dict]:
    """Each encoded result beside psar's prediction of its setting: the published efficiency,
    psar's after backward and overlapped, the errors (predicted less published)."""
    out = []
    for r in RESULTS:
        efficiency, overlapped, comm = predicted_efficiency(r)
        out.append({"name": r.name, "source": r.source, "inputs": r.inputs, "engine": r.engine,
                    "servers": r.servers, "gpus": r.servers * r.gpus_per_server, "compute_s": r.compute_s,
                    "comm_s": comm, "published": r.figure, "predicted": efficiency, "error": efficiency - r.figure,
                    "predicted_overlapped": overlapped, "error_overlapped": overlapped - r.figure})
    return out


def predicted_efficiency(result: Published) -> tuple[float, float, float]:
    """(psar's scaling efficiency with the exchange after backward, and with it overlapping
    backward wholly, and the exchange in seconds) for a published setting."""
    from .predict import Target, exchange

    comm = exchange(result.engine, Target(result.servers, result.rate_bits / 8), 4.0 * result.params)
    backward = BACKWARD_SHARE * result.compute_s
    overlapped = result.compute_s - backward + max(backward, comm)
    return result.compute_s / (result.compute_s + comm), result.compute_s / overlapped, comm
