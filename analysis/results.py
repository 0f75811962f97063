"""Reading run directories: the only input of every table and plot."""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments.engines import get_engine, label_info


def family(label: str) -> str:
    """How a label's runs communicate (EngineSpec.family): "local" (not at all), "ring" (an
    all-reduce of the gradient, and all-gathered rows for a +allgather label) or "ps"."""
    return label_info(label)[0].family


@dataclass(frozen=True)
class Run:
    path: Path
    config: dict
    summary: dict
    metrics: dict[int, list[dict]]

    @property
    def engine(self) -> str:
        return self.summary["engine"]

    @property
    def spec(self):
        """The engine's registry entry (experiments.engines.EngineSpec)."""
        return get_engine(self.engine)

    @property
    def label(self) -> str:
        """Engine plus the setting that distinguishes variants of one engine; the engine's name
        when this process does not know the engine (its module not in $PSAR_ENGINES)."""
        return self.spec.label(self.config) if self.engine_known else self.engine

    @property
    def compression(self) -> str:
        """How the run compressed its gradients, "" for not at all: "topk 0.05", "fp16",
        "powersgd r1" ("no EF" where error feedback was turned off). Runs that differ here
        are different cells of a comparison, never repeats of one."""
        section = self.config.get("compress", {})
        method = section.get("method", "none")
        if method == "none":  # the families' own names for the casts
            family = self.spec.family if self.engine_known else ""
            cast = self.config.get({"ring": "allreduce", "ps": "ps"}.get(family, ""), {}).get("compression", "none")
            return "" if cast in ("none", None) else cast
        detail = {"topk": "ratio", "randomk": "ratio", "qsgd": "levels"}.get(method)
        text = f"{method} {section.get(detail)}" if detail and section.get(detail) is not None else method
        if method == "powersgd":
            text = f"powersgd r{section.get('rank', 1)}"
        return text + (" no EF" if section.get("error_feedback") is False else "")

    @property
    def period(self) -> int:
        """Steps between a worker's exchanges: allreduce.period (ring), ps.push_every and
        ps.fetch_every's larger (Downpour), ps.easgd_tau (ps-easgd); 1 for every step."""
        if self.engine == "ps-easgd":
            return int(self.config.get("ps", {}).get("easgd_tau", 4))
        family = self.spec.family if self.engine_known else ""
        if family == "ring":
            return int(self.config.get("allreduce", {}).get("period", 1))
        if family == "ps":
            ps = self.config.get("ps", {})
            return max(int(ps.get("push_every", 1)), int(ps.get("fetch_every", 1)))
        return 1

    @property
    def fault(self) -> str:
        """The fault injected into the run (fault.*), in words; "" for none. Runs that differ
        here are different cells of a comparison, never repeats of one."""
        fault = self.config.get("fault") or {}
        if fault.get("kill_rank", -1) >= 0:
            return f"rank {fault['kill_rank']} killed at step {fault.get('kill_step', 0)}"
        if fault.get("pause_rank", -1) >= 0 and fault.get("pause_s"):
            return f"rank {fault['pause_rank']} stops {fault['pause_s']:g} s at step {fault.get('pause_step', 0)}"
        if fault.get("slow_rank", -1) >= 0 and fault.get("slow_factor", 1.0) > 1.0:
            return f"rank {fault['slow_rank']} {fault['slow_factor']:g}x slower"
        return ""

    @property
    def engine_known(self) -> bool:
        """Whether this process knows the run's engine (its module imported, see $PSAR_ENGINES)."""
        try:
            self.spec
        except ValueError:
            return False
        return True

    @property
    def asynchronous(self) -> bool:
        """No step waits for every worker: the registry's async and ssp engines (ps-async,
        ps-ssp, ps-easgd) and AD-PSGD (gossip.mode=async)."""
        if not self.engine_known:
            return False
        if self.spec.family == "gossip":
            return (self.config.get("gossip") or {}).get("mode") == "async"
        return self.spec.consistency in ("async", "ssp")

    @property
    def placement(self) -> str | None:
        """Where a ps-* run's shards were on an emulated network ("colocated", "separate", on
        racks "separate in racks 0,1"), with ", phased" under ps.exchange=phased; None for
        other engines and on loopback."""
        net = self.summary.get("network")
        if not self.spec.uses_servers or not net:
            return None
        phased = self.config.get("ps", {}).get("exchange") == "phased"
        where = net.get("placement", "colocated")
        if int(net.get("racks") or 1) > 1 and where == "separate":  # the shards' racks tell runs apart
            where += " in racks " + self.shard_racks
        return where + (", phased" if phased else "")

    @property
    def shard_racks(self) -> str:
        """The racks of the shards on hosts of their own, in shard order ("0,1"); "" where none."""
        rack_of = (self.summary.get("network") or {}).get("rack_of") or {}
        return ",".join(str(rack_of[h]) for h in sorted(rack_of) if h.startswith("s"))

    def records(self) -> list[dict]:
        return [r for rank in sorted(self.metrics) for r in self.metrics[rank]]

    @functools.cached_property
    def started(self) -> float | None:
        """Wall time the earliest rank's loop started (None where records have no wall time)."""
        firsts = [recs[0] for recs in self.metrics.values() if recs]
        if not firsts or any("wall" not in r for r in firsts):
            return None
        return min(r["wall"] - r["time"] for r in firsts)

    def since_start(self, record: dict) -> float:
        """Seconds from the run's start to the end of record's step, on the wall clock: across
        a restart too, whose processes count their own time from their own start."""
        started = self.started
        return record["wall"] - started if started is not None else record["time"]

    def steady_records(self) -> list[dict]:
        """The records after the warm-up step 0 (connection set-up, allocation), if any remain."""
        records = self.records()
        return [r for r in records if r["step"] >= 1] or records


LINKS_BUILT = ("burst_bytes", "packet_bytes")
"""What summary.json's network records of how its emulated links were built: runs on links
built otherwise (a burst of 4 ms of the rate and 64 KiB packets, before they were recorded)
are not repeats of one configuration."""
EMULATION_ONLY = ("net.congestion", "net.queue_ms")
"""Settings of an emulated network's hosts and ports: they change nothing in a run without one
(net.rate ""), where settings() leaves them out (runs recorded before a default changed)."""


def settings(run: Run) -> dict[str, str]:
    """Every setting of the run's config.json as {dotted key: value as JSON text}, a script's
    path and arguments included ("model.args"); without an emulated network, EMULATION_ONLY's
    left out."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True)
    walk("", run.config)
    if not (run.config.get("net") or {}).get("rate"):
        for key in EMULATION_ONLY:
            flat.pop(key, None)
    else:  # the links as they were built, which no setting chooses ("-" in runs before they were recorded)
        network = run.summary.get("network") or {}
        flat |= {f"net.{key}": json.dumps(network[key]) for key in LINKS_BUILT if key in network}
    return flat


def distinctions(runs: list[Run], name_of, ignore: tuple[str, ...] = ()) -> dict[Path, str]:
    """What tells apart runs that name_of(run) would put in one cell though their settings
    differ: {run.path: "key=value, ..."} of the settings that vary among the runs of its
    cell ("" where none do), so that a cell is one configuration and repeats of it alone.
    ignore: settings a figure shows on an axis (workers)."""
    by_name: dict = {}
    for run in runs:
        by_name.setdefault(name_of(run), []).append(run)
    out: dict[Path, str] = {}
    for group in by_name.values():
        flat = [settings(run) for run in group]
        keys = sorted({k for f in flat for k in f})
        varying = [k for k in keys if k not in ignore and len({f.get(k) for f in flat}) > 1]
        for run, f in zip(group, flat):
            out[run.path] = ", ".join(f"{k}={_plain(f.get(k))}" for k in varying)
    return out


def _plain(text: str | None) -> str:
    """A setting's JSON text as a label shows it: strings without quotes, absent as "-"."""
    if text is None:
        return "-"
    value = json.loads(text)
    return value if isinstance(value, str) else text


TARGET_WINDOW = 5
"""Steps averaged when deciding that a run reached its target loss (one lucky batch is not)."""


def time_to_target(run: Run, target: float | None = None) -> tuple[int, float] | None:
    """(steps, seconds) until the training loss, averaged over the workers and over the last
    TARGET_WINDOW steps, first reached `target` (default: the run's target_loss); seconds
    count from the start of the loop to the moment every worker had finished that step.
    None if there is no target or the run never reached it."""
    target = target if target is not None else run.config.get("target_loss") or 0.0
    if not target:
        return None
    by_step: dict[int, list[dict]] = {}
    for record in run.records():
        by_step.setdefault(record["step"], []).append(record)
    window: list[float] = []
    for step in sorted(by_step):
        records = by_step[step]
        window = (window + [sum(r["loss"] for r in records) / len(records)])[-TARGET_WINDOW:]
        if len(window) == TARGET_WINDOW and sum(window) / TARGET_WINDOW <= target:
            return step + 1, max(run.since_start(r) for r in records)
    return None


def load_run(path: Path) -> Run:
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a finished run directory: {err}") from None
    metrics = {}
    for file in sorted((path / "metrics").glob("rank*.jsonl")):
        lines = file.read_text().splitlines()
        metrics[int(file.stem[4:])] = [json.loads(line) for line in lines if line.strip()]
    return Run(path, config, summary, metrics)


def load_runs(paths) -> list[Run]:
    """The runs in `paths`: run directories, or folders holding them (a `psar compare` output,
    whose runs are in its runs/, or any folder of run directories)."""
    return [load_run(p) for p in expand(paths)]


def expand(paths) -> list[Path]:
    """Run directories named by `paths`: each path itself if it holds a summary.json, else the
    run directories found in it (in its runs/ first, as `psar compare` writes them)."""
    out = []
    for path in map(Path, paths):
        inner = _folder(path)
        if inner is None:
            out.append(path)
            continue
        found = sorted(p for p in inner.iterdir() if (p / "summary.json").exists())
        if not found:
            raise ValueError(f"{path} is neither a finished run directory (no summary.json) nor a "
                             "folder of them")
        out.extend(found)
    return out


def _folder(path: Path) -> Path | None:
    """Where the runs of a folder of them are (its runs/ first, as `psar compare` writes
    them); None where path is a run directory itself (it has a summary.json) or no folder."""
    if (path / "summary.json").exists() or not path.is_dir():
        return None
    return path / "runs" if (path / "runs").is_dir() else path


def skipped(paths) -> list[tuple[Path, str]]:
    """The directories in the folders of `paths` that expand leaves out, each with why: a
    failed run (its worker's own account, "psar: ..." in its logs), an unfinished one (a
    config.json and no summary.json: still running, or stopped), or not a run at all."""
    out = []
    for inner in filter(None, map(_folder, map(Path, paths))):
        for p in sorted(inner.iterdir()):
            if (p / "summary.json").exists():
                continue
            if not (p / "config.json").exists():
                out.append((p, "not a run (no config.json)"))
                continue
            said = [line for log in sorted((p / "logs").glob("*.log")) if log.is_file()
                    for line in log.read_text(errors="replace").splitlines() if line.startswith("psar: ")]
            out.append((p, f"failed: {said[-1][6:]}" if said else "unfinished (no summary.json)"))
    return out


def by_experiment(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs grouped by experiment: only runs of one experiment belong in one figure."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.summary["experiment"], []).append(run)
    return groups


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mean_step(run: Run) -> float:
    """Mean step_s over ranks and steps, step 0 skipped."""
    steps = [r["step_s"] for r in run.steady_records()]
    return sum(steps) / len(steps)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
