"""What a run moved per step, read off its run directory (model.pt, metrics): the input of
the link model and the cost model alike."""

from __future__ import annotations

from dataclasses import dataclass

from .results import Run, family, median


@dataclass(frozen=True)
class Traffic:
    """Bytes a worker moves per step, as the models take them."""

    push: float
    """M: what each worker all-reduces (ring) or pushes (ps)."""
    pull: float | None = None
    """ps: what each worker pulls back (None: M)."""
    gathered: float = 0.0
    """Rows all-gathered: what each host sends (and receives) per step."""


def _floating_state(run: Run) -> dict:
    import torch  # only the run-directory readers need torch

    path = run.path / "model.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    return {name: t for name, t in state.items() if torch.is_tensor(t) and t.is_floating_point()}


def _floating_tensors(run: Run) -> list:
    return list(_floating_state(run).values())


def push_messages(run: Run) -> list[int] | None:
    """Bytes of each push message a ps worker sends a step, in the order they leave: the
    model's parameters from last to first (the order backward produces their gradients), each
    cut into its keys (ps.chunk_mb, by net.rate where it is 0, as the run's layout cuts it),
    gathered until a message holds ps.bucket_kb KiB, as the engine's buckets are, even between
    one parameter's keys. None where the run's summary records another cut of its keys
    (ps.layout.Layout.cut): tables it moved by rows, or another psar's layout, whose messages
    model.pt does not tell."""
    from experiments.settings.net import parse_rate
    from ps.config import PSConfig, key_mb
    from ps.layout import ParamSpec, build_layout, chunk_elems_from_mb, dtype_name

    section = {"chunk_mb": PSConfig.chunk_mb, "bucket_kb": PSConfig.bucket_kb, **run.config.get("ps", {})}
    rate = (run.config.get("net") or {}).get("rate")
    chunk_mb = key_mb(section["chunk_mb"], parse_rate(rate) if rate else None)
    cap = section["bucket_kb"] * 1024
    params = [t for name, t in _floating_state(run).items() if not name.endswith(("running_mean", "running_var"))]
    if not params:
        return []
    specs = [ParamSpec(str(i), tuple(t.shape), dtype_name(t.dtype)) for i, t in enumerate(params)]
    servers = int(run.config.get("servers", 1) or 1)
    layout = build_layout(specs, servers, chunk_elems_from_mb(chunk_mb, params[0].element_size()))
    recorded = (run.summary.get("layout") or {}).get("cut")
    if recorded is not None and recorded != layout.cut:
        return None
    sizes, bucket = [], 0
    for p in reversed(range(len(params))):
        for key in layout.param_keys(p):
            bucket += layout.nbytes(key)
            if bucket >= cap:
                sizes.append(bucket)
                bucket = 0
    return sizes + [bucket] if bucket else sizes


def gradient_bytes(run: Run) -> int:
    """M: bytes of the floating-point tensors of the run's model.pt.

    Floating buffers (BatchNorm running mean and variance) are included: they are a few KB
    next to the weights; the integer num_batches_tracked is not.
    """
    return sum(t.numel() * t.element_size() for t in _floating_tensors(run))


def wire_bytes(run: Run) -> int:
    """Bytes each worker sends into the all-reduce: M, or 2 per element with fp16/bf16 compression."""
    compression = run.config.get("allreduce", {}).get("compression", "none")
    if family(run.label) == "ring" and compression != "none":
        return sum(2 * t.numel() for t in _floating_tensors(run))
    return gradient_bytes(run)


def run_traffic(run: Run) -> Traffic:
    """What a run's workers moved per step, as the models take it: the all-reduced gradient
    (M, from model.pt; with gathered tables, what the buckets carried) and the rows an
    all-gather carried besides (each rank's records); for
    a parameter server the bytes pushed and pulled as the records count them (row-sparse
    tables move only their rows; ps.compression halves them), or M where nothing was counted."""
    kind = family(run.label)
    if kind == "ps":
        records = [r for r in run.steady_records() if r.get("bytes_sent")]
        if records:
            return Traffic(median([r["bytes_sent"] for r in records]), median([r.get("bytes_recv", 0) for r in records]))
        return Traffic(float(wire_bytes(run)))
    method = run.config.get("compress", {}).get("method", "none")
    if kind == "ring" and method not in ("none", "fp16", "bf16"):  # the casts are priced by wire_bytes
        records = [r for r in run.steady_records() if r.get("bytes_sent")]
        if records:
            return compressed_traffic(method, median([r["bytes_sent"] for r in records]), run.summary["workers"])
    records = [r for r in run.steady_records() if "gathered_bytes" in r] if kind == "ring" else []
    if records:  # the tables are gathered, not all-reduced: M is what the buckets carried
        return Traffic(median([r["bytes_sent"] - r["gathered_bytes"] for r in records]),
                       gathered=median([r["gathered_bytes"] for r in records]))
    return Traffic(float(wire_bytes(run)))


def compressed_traffic(method: str, sent: float, workers: int) -> Traffic:
    """What a compressed ring run moved, from the bytes each worker sent per step: messages
    that add up (random-k, PowerSGD's P and Q) are all-reduced, so M is sent / (2(N-1)/N);
    the others (top-k, sign, QSGD) are all-gathered, each host sending N-1 messages."""
    from experiments.compression import CompressConfig

    compressor, _ = CompressConfig(method=method).build()
    if compressor.adds_up:
        return Traffic(sent * workers / (2 * (workers - 1)) if workers > 1 else 0.0)
    return Traffic(0.0, gathered=sent)
