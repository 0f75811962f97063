"""How busy the host's cores were during a run's steps, read off its cpu.json (the machine's
CPU time counters every few tens of ms, experiments/runtime/cpumeter.py) and rank 0's step
ends (analysis/links.steps).

Where one machine runs every worker, every shard and the kernel that emulates their links,
its cores are one more resource the engines share, and one a cluster's hosts would not: a
parameter server's shards and its workers' pushes cost CPU on the same cores. Once they are
all busy, the comparison measures the machine's cores as much as the links, and a prediction
carried from fewer workers (psar predict) misses by what they add. The shares are of all the
host's cores over the steps' windows together: in use (not idle), busy (user, nice, system,
irq and soft interrupts, which carry the emulated links' packets), each of those apart, steal
(time a virtual machine's cores were taken by its hypervisor: in use, but not by the run) and
idle.

Where the launcher counted its processes too, host_cpu says how many cores its ranks and its
shards held through the steps, each together and the busiest one alone, the kernel's work on
their behalf included (their sends, and soft interrupts that ran in their context); the rest
of the time in use is the kernel's work outside them, the launcher's and anything else on
the host. A shard process near one core whole is a shard whose Python work sets the pace: its
updates and its I/O threads can use more, its message handling cannot.
"""

from __future__ import annotations

from experiments.runtime.cpumeter import CPU_FILE

from .links import carried, read_timeline, steps
from .results import Run

BUSY = ("user", "nice", "system", "irq", "softirq")
"""The states of a core at work."""

SATURATED = 0.9
"""A host whose cores were in use (not idle) this share of the steps or more: its cores, not
only its links, decided the steps (psar links, the verdict and psar predict --validate say
so)."""


def timeline(run: Run) -> dict | None:
    """The run's cpu.json (None where it has none: a run from before it, or a process started
    by hand)."""
    path = run.path / CPU_FILE
    data = read_timeline(path, "ticks", "the host's CPU timeline")
    if data is None:
        return None
    if not (type(data.get("cores")) is int and data["cores"] >= 1):
        raise ValueError(f"{path}: cannot read the host's CPU timeline: cores={data.get('cores')!r}")
    processes = data.get("processes", {})
    if not (isinstance(processes, dict) and all(isinstance(c, list) and len(c) == len(data["t"])
                                                 for c in processes.values())):
        raise ValueError(f"{path}: cannot read the host's CPU timeline: the processes' counts and the times differ")
    return data


SHARD_BOUND = 0.9
"""A shard process that held this much of a core or more through the steps: a shard handles
its messages on one thread (its updates' kernels and its I/O threads can use more), so there
the shard, not the links or the algorithm, set the pace (psar links and the verdict say so)."""

ROLES = (("ranks", "rank "), ("shards", "server "))
"""The launcher's processes by kind (their names in the launcher: "rank 0", "server 1")."""


def host_cpu(run: Run) -> dict | None:
    """{"used": share of the host's cores not idle over rank 0's steps (the first left out),
    "busy": at work (BUSY's states), each of those states, "steal" and "idle" apart, "cores",
    "steps"}, and where the launcher's processes were counted, "processes": {name: cores it
    held through those steps} and for each kind (ROLES) its cores together and its busiest
    one's ("ranks", "ranks_max", "shards", "shards_max"); None without a timeline, a whole
    step inside it, or ticks counted in those steps."""
    data = timeline(run)
    if data is None:
        return None
    t = data["t"]
    windows = steps(run, (t[0], t[-1]))
    if not windows:
        return None
    ticks = {state: sum(carried(t, counts, a, b) for a, b in windows) for state, counts in data["ticks"].items()}
    total = sum(ticks.values())
    if total <= 0:
        return None
    shares = {state: ticks.get(state, 0.0) / total for state in (*BUSY, "steal")}
    idle = (ticks.get("idle", 0.0) + ticks.get("iowait", 0.0)) / total
    cores = int(data["cores"])
    found = {"used": 1.0 - idle, "busy": sum(shares[s] for s in BUSY), **shares, "idle": idle,
             "cores": cores, "steps": len(windows)}
    if data.get("processes"):
        held = {name: cores * sum(carried(t, counts, a, b) for a, b in windows) / total
                for name, counts in data["processes"].items()}
        found["processes"] = held
        for kind, prefix in ROLES:
            mine = [c for name, c in held.items() if name.startswith(prefix)]
            found[kind], found[f"{kind}_max"] = (sum(mine), max(mine)) if mine else (None, None)
    return found


def busiest_shard(run: Run) -> float | None:
    """The cores the busiest shard process of the run held through its steps (host_cpu's
    "shards_max"); None without shards or their counts."""
    found = host_cpu(run)
    return found.get("shards_max") if found else None


def host_used(run: Run) -> float | None:
    """The share of the host's cores not idle during the run's steps (host_cpu's "used"):
    at work, or, on a virtual machine, taken by its hypervisor (steal); None without a
    timeline."""
    found = host_cpu(run)
    return found["used"] if found else None


def line(run: Run) -> str | None:
    """One line of what the host's cores did during the steps, as `psar links` prints it."""
    found = host_cpu(run)
    if found is None:
        return None
    shown = [f"{name} {found[name]:.0%}" for name in ("user", "system", "softirq", "steal") if found[name] >= 0.005]
    parts = f" ({', '.join(shown)})" if shown else ""
    held = "".join(f"; {kind} {found[kind]:.2f} cores (the busiest {found[f'{kind}_max']:.2f})"
                   for kind, _ in ROLES if found.get(kind) is not None)
    if (found.get("shards_max") or 0.0) >= SHARD_BOUND:
        held += "; a shard held a whole core: its message handling set the pace"
    saturated = "; saturated: the cores set the steps' pace as much as the links" if found["used"] >= SATURATED else ""
    return f"host: {found['cores']} cores, {found['idle']:.0%} idle over {found['steps']} steps{parts}{held}{saturated}"
