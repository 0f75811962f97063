"""`psar bench`: measurements, not tests. Every figure is a ratio of two things timed in one run."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from allreduce.benchmark import BUDGET_S, ROUNDS
from ps.cores import host_cores
from experiments.bench import bench_server, size_label
from experiments.bench.collectives import collectives_goals
from experiments.bench.compression import compression_goals
from experiments.bench.faults import faults_goals
from experiments.bench.startup import format_startup, startup
from experiments.bench.fabric import fabric_if_possible
from experiments.bench.incast import incast_if_possible
from experiments.bench.legs import format_legs_table, push_pull_legs
from experiments.bench.shard_loop import format_shard_loop, shard_loop
from experiments.bench.update_threads import format_update_threads_table, update_threads_table
from experiments.rundir import files
from experiments.runtime.cpumeter import cores_in_windows
from experiments.runtime.launcher import free_port, launch_batch, process_shape, run_ranks
from experiments.rundir.metrics import read_metrics, throughput
from experiments.settings.presets import build_config

SKIP_STEPS = 3
"""Steps left out of each throughput figure (allocation, connection and cache warm-up)."""


def samples_per_sec(run_dir: Path, skip: int = SKIP_STEPS) -> float:
    """The summary's throughput definition, with a longer warm-up left out."""
    return throughput(read_metrics(run_dir), warmup=skip)


def engine_throughput(experiment: str, variants: dict[str, tuple[str, tuple[str, ...]]],
                      workers: int, steps: int, rounds: int, out: Path) -> dict[str, list[float]]:
    """samples/s of each variant (engine, overrides), in interleaved rounds.

    Variants that need the same processes share them within a round; the rest take turns.
    """
    result: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        groups: dict[tuple[int, int], list[tuple[str, object, Path]]] = {}
        for name, (engine, overrides) in variants.items():
            cfg = build_config(experiment, overrides, engine=engine, workers=workers, steps=steps)
            groups.setdefault(process_shape(cfg), []).append((name, cfg, out / f"{name}-round{r}"))
        for group in groups.values():
            launch_batch([(cfg, run_dir) for _, cfg, run_dir in group], quiet=True)
            for name, _, run_dir in group:
                result[name].append(samples_per_sec(run_dir))
    return result


def rpc_throughput(experiment: str, workers: int, steps: int, rounds: int, out: Path) -> list[float]:
    """samples/s of the torch.distributed.rpc parameter server (experiments/bench/rpc_baseline.py): one
    server process and `workers` workers, `rounds` times."""
    rates = []
    for r in range(rounds):
        path = out / f"rpc-ps-round{r}.json"
        run_ranks([sys.executable, "-m", "experiments.bench.rpc_baseline", experiment, str(steps), str(path)],
                  workers + 1, out / f"logs-rpc-ps-round{r}")
        rates.append(json.loads(path.read_text())["samples_per_sec"])
    return rates


def rpc_pairs(experiment: str, workers: int, steps: int, rounds: int, out: Path) -> dict[str, list[float]]:
    """samples/s of ps-sync and of the torch.distributed.rpc server, a run of each in turn,
    `rounds` times: each pair a moment apart, so that their ratio is the machine's of that
    moment (ratios: ps-sync's over the rpc server's, pair by pair)."""
    ps, rpc = [], []
    for r in range(rounds):
        where = out / f"rpc-pair{r}"
        where.mkdir(parents=True, exist_ok=True)
        ps += engine_throughput(experiment, {"ps-sync": ("ps-sync", ())}, workers, steps, 1, where)["ps-sync"]
        rpc += rpc_throughput(experiment, workers, steps, 1, where)
    return {"ps_sync": ps, "rpc_ps": rpc, "ratios": [a / b for a, b in zip(ps, rpc)]}


def ps_bandwidth(out: Path) -> list[dict]:
    """One worker against one shard in another process; see ps/benchmark.py."""
    from ps.benchmark import measure

    with bench_server(out / "ps-bench-server.log") as (echo, shard):
        return measure(echo, shard)


def clear_load_files(where: Path) -> None:
    """Remove an earlier many-worker row's start file and counts from its folder: loads that
    found its start (long past) would count nothing."""
    for stale in [where / "go", *where.glob("worker*.json*")]:
        stale.unlink(missing_ok=True)


def ps_load(out: Path, workers: int = 8, shard_counts: tuple[int, ...] = (1, 4)) -> list[dict]:
    """`workers` worker processes against 1 and 4 shards on this host (worker w on shard
    w mod shards), each shard with an echo socket beside it: the bytes/s all of them move
    through the shards, against what they move through the echoes; see ps/benchmark.py.
    The shards share the cores the workers leave (at least one thread each)."""
    from ps.benchmark import LOAD_GAP_S, LOAD_PHASE_S, LOAD_SIZES, aggregate
    from ps.transport import ClientTransport

    rows = []
    for shards in shard_counts:
        where = out / f"ps-load-{shards}"
        where.mkdir(parents=True, exist_ok=True)
        clear_load_files(where)
        addrs = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(shards)]
        with open(where / "servers.log", "w") as log:
            # each load is one busy thread: the shards share the cores the loads leave
            threads = max(1, (host_cores() - workers) // shards)
            servers = [subprocess.Popen([sys.executable, "-m", "ps.benchmark", "serve", echo, shard,
                                         str(len(range(s, workers, shards))), str(threads)], stdout=log, stderr=log)
                       for s, (echo, shard) in enumerate(addrs)]
            go = where / "go"
            outs = [where / f"worker{w}.json" for w in range(workers)]
            loads = [subprocess.Popen([sys.executable, "-m", "ps.benchmark", "load", *addrs[w % shards],
                                       str(w // shards), str(go), str(outs[w])], stdout=log, stderr=log)
                     for w in range(workers)]
            try:
                deadline = time.monotonic() + 120
                while not all(Path(f"{o}.ready").exists() for o in outs):
                    if time.monotonic() > deadline or any(p.poll() for p in servers + loads):
                        raise RuntimeError("psar bench: the many-worker rows did not start; see "
                                           f"{where / 'servers.log'}")
                    time.sleep(0.05)
                go_at = time.time() + 0.5
                files.write_text(go, repr(go_at))
                cores = cores_in_windows([p.pid for p in servers], load_windows(go_at))
                for p in loads:
                    p.wait(len(LOAD_SIZES) * 2 * (LOAD_PHASE_S + LOAD_GAP_S) + 60)
                for echo, _ in addrs:
                    stopper = ClientTransport(echo, None, 10.0)
                    stopper.send([b"stop"])
                    stopper.recv(10.0, "the echo's stop")
                    stopper.close()
                for p in servers:
                    p.wait(30)
            finally:
                for p in servers + loads:
                    if p.poll() is None:
                        p.kill()
        if any(p.returncode for p in loads):
            raise RuntimeError(f"psar bench: a many-worker load failed; see {where / 'servers.log'}")
        counts = [json.loads(o.read_text()) for o in outs]
        rows += [{"workers": workers, "shards": shards, **row, "echo_cores": cores[2 * i],
                  "shard_cores": cores[2 * i + 1]} for i, row in enumerate(aggregate(counts))]
    return rows


def load_windows(go_at: float) -> list[tuple[float, float]]:
    """The wall-clock (start, end) of each phase of the many-worker rows that start at go_at,
    in order: for each of LOAD_SIZES its ZeroMQ phase, then its push+pull phase (ps.benchmark.load)."""
    from ps.benchmark import LOAD_GAP_S, LOAD_PHASE_S, LOAD_SIZES

    out = []
    for i in range(len(LOAD_SIZES)):
        begin = go_at + i * 2 * (LOAD_PHASE_S + LOAD_GAP_S)
        out += [(begin, begin + LOAD_PHASE_S), (begin + LOAD_PHASE_S + LOAD_GAP_S, begin + 2 * LOAD_PHASE_S + LOAD_GAP_S)]
    return out


def format_ps_load_table(rows: list[dict]) -> str:
    lines = ["parameter server under load: N workers push+pull against shards on one host, against as many "
             "ZeroMQ echoes (all bytes/s through them, each way); cores: the busiest server process's while it "
             "echoed, and while it served the push+pulls (a shard near 1.00 is bound by its one thread of "
             "message handling)",
             f"{'workers':>8} {'shards':>7} {'size':>8} {'zmq(GB/s)':>10} {'ps(GB/s)':>9} {'ps/zmq':>7}"
             f" {'cores echo':>11} {'shard':>6}"]
    for r in rows:
        lines.append(f"{r['workers']:>8} {r['shards']:>7} {size_label(r['bytes']):>8} {r['zmq_gbs']:>10.3f} "
                     f"{r['ps_gbs']:>9.3f} {r['ratio']:>6.2f}x {_cores(r.get('echo_cores')):>11} "
                     f"{_cores(r.get('shard_cores')):>6}")
    return "\n".join(lines)


def _cores(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_ps_table(rows: list[dict]) -> str:
    lines = ["parameter server: one worker, one shard, push+pull of N bytes vs a ZeroMQ round trip "
             "of N bytes (medians of 9 rounds; ps/zmq: of each round's pair): one at a time, and streamed "
             "(3 MiB in flight, at most 8)",
             f"{'size':>10} {'zmq(us)':>10} {'zmq(GB/s)':>10} {'ps(us)':>10} {'ps(GB/s)':>10} {'ps/zmq':>7}"
             f" {'streamed zmq(GB/s)':>19} {'ps(GB/s)':>9} {'ps/zmq':>7}"]
    for r in rows:
        streamed = (f" {r['stream_zmq_gbs']:>19.3f} {r['stream_ps_gbs']:>9.3f} {r['stream_ratio']:>6.2f}x"
                    if "stream_ratio" in r else "")
        lines.append(f"{size_label(r['bytes']):>10} {r['zmq_us']:>10.1f} {r['zmq_gbs']:>10.3f} "
                     f"{r['ps_us']:>10.1f} {r['ps_gbs']:>10.3f} {r['ratio']:>6.2f}x{streamed}")
    goals = []
    for (low, high), goal in PS_GOALS.items():
        ratios = [r["ratio"] for r in rows if low <= r["bytes"] <= high]
        if ratios:
            goals.append(f"{size_label(low)} to {size_label(high)} at least {min(ratios):.2f} (goal: {goal})")
    if goals:
        lines.append("push+pull / ZeroMQ, one at a time: " + "; ".join(goals))
    return "\n".join(lines)


PS_GOALS = {(1 << 10, 64 << 10): 0.5, (1 << 20, 4 << 20): 0.8}
"""The push+pull path's goals on a 2-core machine (ps/zmq, one at a time, by size range): a
push+pull costs about what ZeroMQ's round trip of the same bytes costs. On 16 cores: 0.5 below
256 KiB and 0.85 from it."""


def allreduce_table(workers: int, out: Path) -> dict:
    path = out / "allreduce.json"
    run_ranks([sys.executable, "-m", "allreduce.benchmark", str(path)], workers, out / "logs-allreduce")
    return json.loads(path.read_text())


def format_allreduce_table(table: dict) -> str:
    lines = [f"all-reduce, {table['world']} ranks, {table['backend']} (float32, sum; the algorithms take turns "
             f"in {ROUNDS} rounds of {BUDGET_S * 1e3:g} ms each, twice as many up to 1 MiB; medians)",
             f"{'size':>10} {'algorithm':>16} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
             f" {'busbw / library':>16}"]
    for row in table["rows"]:
        ratio = row.get("vs_library") if row["algorithm"] != "library" else None
        lines.append(f"{size_label(row['bytes']):>10} {row['algorithm']:>16} {row['time_us']:>10.1f} "
                     f"{row['algbw_gbs']:>12.3f} {row['busbw_gbs']:>12.3f} "
                     f"{'' if ratio is None else f'{ratio:.2f}x':>16}")
    ring = [r for r in table["rows"] if r["algorithm"] == "ring" and "vs_library" in r]
    small = [r for r in ring if r["bytes"] == 1024]
    large = [r["vs_library"] for r in ring if r["bytes"] >= 4 << 20]
    if small and large:
        lines.append(f"ring: 1 KiB in {1 / small[0]['vs_library']:.2f}x the library's time (goal: at most 2); "
                     f"from 4 MiB {min(large):.2f}x to {max(large):.2f}x its busbw (goal: at least 0.9)")
    return "\n".join(lines)


def latency_table(ranks: int, out: Path) -> str:
    """Ring against halving-doubling and tree on `ranks` ranks with a per-message delay (LATENCY)."""
    path = out / f"allreduce-latency-{ranks}.json"
    run_ranks([sys.executable, "-m", "allreduce.benchmark", str(path), "--latency"], ranks,
              out / f"logs-allreduce-latency-{ranks}")
    rows = {r["algorithm"]: r for r in json.loads(path.read_text())["rows"]}
    ring, hd, tree = rows["ring"], rows["halving-doubling"], rows["tree"]
    return (f"{size_label(ring['bytes'])} on {ranks} ranks, {ring['delay_ms']:g} ms per message: ring "
            f"{ring['time_us'] / 1e3:.1f} ms, halving-doubling {hd['time_us'] / 1e3:.1f} ms = "
            f"{hd['time_us'] / ring['time_us']:.2f}x, tree {tree['time_us'] / 1e3:.1f} ms = "
            f"{tree['time_us'] / ring['time_us']:.2f}x (goal: one of them <= 0.7)")


QUICK_VARIANTS = {"allreduce": ("allreduce", ()), "ps-sync": ("ps-sync", ())}
QUICK_STEPS = 150
"""quickstart's own step count: its steps take a few ms, so the PS's per-step cost shows."""

SPARSE_VARIANTS = {"ps-sync": ("ps-sync", ()), "ps-async": ("ps-async", ()),
                   "allreduce-dense": ("allreduce", ("allreduce.sparse=dense",)),
                   "allreduce-allgather": ("allreduce", ("allreduce.sparse=allgather",)),
                   "ddp": ("ddp", ())}


def sparse_table(workers: int, steps: int, rounds: int, out: Path) -> dict[str, dict]:
    """dlrm at its defaults: each variant's samples/s (median of rounds) and bytes per worker
    per step, and both as ratios to dense all-reduce."""
    tput = engine_throughput("dlrm", SPARSE_VARIANTS, workers, steps, rounds, out)
    rows = {}
    for name in SPARSE_VARIANTS:
        rates = [v for v in tput[name] if v is not None]  # None: too few steps to measure
        rows[name] = {"samples_per_sec": statistics.median(rates) if rates else None, "rounds": tput[name],
                      "bytes_per_worker_per_step": _median_bytes(out, name, rounds)}
    dense = rows["allreduce-dense"]
    for row in rows.values():
        row["bytes_vs_dense"] = row["bytes_per_worker_per_step"] / dense["bytes_per_worker_per_step"]
        both = row["samples_per_sec"] and dense["samples_per_sec"]
        row["speed_vs_dense"] = row["samples_per_sec"] / dense["samples_per_sec"] if both else None
    return rows


def format_sparse_table(rows: dict[str, dict], workers: int, steps: int, rounds: int) -> str:
    lines = [f"dlrm (embedding tables), {workers} workers, {steps} steps x {rounds} interleaved rounds "
             f"(first {SKIP_STEPS} skipped):",
             f"  {'variant':20s} {'samples/s':>10} {'x dense':>8} {'bytes/worker/step':>18} {'/ dense':>9}"]
    for name, r in rows.items():
        rate, speed = r["samples_per_sec"], r["speed_vs_dense"]
        lines.append(f"  {name:20s} {'-' if rate is None else f'{rate:.1f}':>10} "
                     f"{'-' if speed is None else f'{speed:.2f}x':>8} "
                     f"{r['bytes_per_worker_per_step']:>18.0f} {r['bytes_vs_dense']:>9.5f}")
    return "\n".join(lines)


def _median_bytes(out: Path, name: str, rounds: int) -> float:
    """A variant's bytes per worker per step (summary.json), median over its rounds."""
    return statistics.median(files.read_json(out / f"{name}-round{r}" / "summary.json")["bytes_per_worker_per_step"]
                             for r in range(rounds))


def run(echo: Callable[[str], None] = print, steps: int = 15, rounds: int = 3,
        workers: int = 2, out: Path | None = None) -> dict:
    out = Path(out or tempfile.mkdtemp(prefix="psar-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    echo(f"bench: results under {out}")
    start = startup(rounds, workers, out)
    echo(format_startup(start, workers))
    echo("")
    table = allreduce_table(workers, out)
    echo(format_allreduce_table(table))
    echo(latency_table(8, out))
    echo("")
    ps_rows = ps_bandwidth(out)
    echo(format_ps_table(ps_rows))
    legs = push_pull_legs(out)
    echo(format_legs_table(legs))
    load_rows = ps_load(out)
    echo(format_ps_load_table(load_rows))
    update_rows = update_threads_table()
    echo(format_update_threads_table(update_rows))
    loop_rows = shard_loop()
    echo(format_shard_loop(loop_rows))
    carried = fabric_if_possible(echo)
    incast_rows = incast_if_possible(echo)
    echo("")
    variants = {"ddp": ("ddp", ()), "allreduce": ("allreduce", ()),
                "allreduce-ring": ("allreduce", ("allreduce.algorithm=ring",)),
                "ps-sync": ("ps-sync", ()), "ps-sync-bf16": ("ps-sync", ("ps.compression=bf16",)),
                "ps-async": ("ps-async", ())}
    tput = engine_throughput("mlp-wide", variants, workers, steps, rounds, out)
    med = {name: statistics.median(v) for name, v in tput.items()}
    echo(f"mlp-wide, {workers} workers, batch 64/worker, {steps} steps x {rounds} interleaved rounds "
         f"(first {SKIP_STEPS} steps skipped), samples/s:")
    for name, values in tput.items():
        ratio = med[name] / med["ddp"]
        echo(f"  {name:15s} median {med[name]:8.1f}  rounds {', '.join(f'{v:.1f}' for v in values)}"
             f"  = {ratio:.3f}x ddp")
    wire = {name: _median_bytes(out, name, rounds) for name in ("ps-sync", "ps-sync-bf16")}
    echo(f"  ps.compression=bf16: {wire['ps-sync-bf16']:.0f} bytes/worker/step = "
         f"{wire['ps-sync-bf16'] / wire['ps-sync']:.3f} of float32's {wire['ps-sync']:.0f}, "
         f"samples/s {med['ps-sync-bf16'] / med['ps-sync']:.2f}x ps-sync")
    quick = engine_throughput("quickstart", QUICK_VARIANTS, workers, QUICK_STEPS, rounds, out)
    quick_med = {name: statistics.median(v) for name, v in quick.items()}
    echo(f"quickstart, {workers} workers, {QUICK_STEPS} steps x {rounds} interleaved rounds, samples/s: "
         + ", ".join(f"{name} median {quick_med[name]:.0f} (rounds {', '.join(f'{v:.0f}' for v in quick[name])})"
                     for name in QUICK_VARIANTS))
    echo(f"  ps-sync / allreduce = {quick_med['ps-sync'] / quick_med['allreduce']:.2f}x")
    pairs = rpc_pairs("mlp-wide", workers, steps, rounds, out)
    rpc_rates = pairs["rpc_ps"]
    echo(f"  {'rpc-ps':15s} median {statistics.median(rpc_rates):8.1f}  rounds "
         f"{', '.join(f'{v:.1f}' for v in rpc_rates)}  (torch.distributed.rpc batch-update server, the pattern "
         f"of PyTorch's examples), each round right after a ps-sync run of its own: "
         f"{', '.join(f'{v:.1f}' for v in pairs['ps_sync'])}")
    echo(f"  ps-sync / rpc-ps = {statistics.median(pairs['ratios']):.2f}x (median of the pairs: "
         f"{', '.join(f'{v:.2f}' for v in pairs['ratios'])})")
    echo("")
    sparse = sparse_table(workers, min(steps, 20), rounds, out)
    echo(format_sparse_table(sparse, workers, min(steps, 20), rounds))
    echo("")
    compression = compression_goals(out, echo)
    echo("")
    collectives = collectives_goals(out, echo)
    echo("")
    fault_report = faults_goals(out, echo)
    report = {"collectives": collectives, "faults": fault_report, "allreduce_table": table, "ps_bandwidth": ps_rows, "ps_legs": legs, "ps_load": load_rows,
              "update_threads": update_rows, "shard_loop": loop_rows, "throughput": tput, "median": med,
              "quickstart": quick, "startup": start,
              "rpc_ps": rpc_rates, "rpc_pairs": pairs, "sparse": sparse, "compression": compression}
    if carried is not None:
        report["fabric"] = carried
    if incast_rows is not None:
        report["incast"] = incast_rows
    files.write_json(out / "bench.json", report)
    return report
