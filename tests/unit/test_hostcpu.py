"""The host's CPU timeline of a run (experiments/runtime/cpumeter.py) and what psar makes of
it (analysis/hostcpu.py): /proc/stat read, a meter reading a changing file, the shares of
the cores over a run's steps on made-up counters."""

from __future__ import annotations

import json
import os
import time

import pytest

from analysis.hostcpu import SATURATED, host_used, host_cpu, line
from analysis.results import load_run
from experiments.runtime.cpumeter import CPU_FILE, STATES, CpuMeter, read_process, read_stat

STAT = """cpu  {user} 0 {system} {idle} 5 0 {softirq} {steal} 0 0
cpu0 40 0 10 100 2 0 3 1 0 0
cpu1 60 0 10 200 3 0 4 2 0 0
intr 12345
ctxt 678
"""


def _stat(user=100, system=20, idle=300, softirq=7, steal=3) -> str:
    return STAT.format(user=user, system=system, idle=idle, softirq=softirq, steal=steal)


def test_every_cores_ticks_or_those_of_the_cores_the_run_may_use():
    ticks, cores = read_stat(_stat())
    assert cores == 2
    assert ticks == {"user": 100, "nice": 0, "system": 20, "idle": 300, "iowait": 5, "irq": 0, "softirq": 7,
                     "steal": 3}
    ticks, cores = read_stat(_stat(), frozenset({1, 5}))  # core 5 is not on this machine
    assert cores == 1 and ticks["user"] == 60 and ticks["idle"] == 200 and ticks["steal"] == 2
    with pytest.raises(ValueError, match="none of the cores"):
        read_stat(_stat(), frozenset({7}))
    with pytest.raises(ValueError, match="not integers"):
        read_stat(_stat().replace(" 20 ", " x "))
    with pytest.raises(ValueError, match="every core"):
        read_stat("intr 1\n")
    with pytest.raises(ValueError, match="no line of a core"):
        read_stat(_stat().split("cpu0")[0])


def test_a_meter_reads_the_counters_as_they_grow_and_one_that_cannot_read_says_so(tmp_path):
    path = tmp_path / "stat"

    def write(text):  # whole, as the kernel gives /proc/stat: never a file half written
        (tmp_path / "next").write_text(text)
        os.replace(tmp_path / "next", path)
    write(_stat())
    meter = CpuMeter(0.01, path).start()
    try:
        time.sleep(0.05)
        write(_stat(user=150, idle=320))
        time.sleep(0.05)
    finally:
        meter.stop()
    out = meter.timeline()
    assert meter.error is None and out["cores"] == 2 and len(out["t"]) >= 2  # the first and the last at stop
    assert out["ticks"]["user"][0] == 0 and out["ticks"]["user"][-1] == 50 and out["ticks"]["idle"][-1] == 20
    assert out["t"] == sorted(out["t"])
    with pytest.raises(OSError, match="CPU meter"):
        CpuMeter(0.01, tmp_path / "missing").start()


def test_a_launch_whose_meter_cannot_start_goes_on_without_it(monkeypatch, capsys):
    from experiments.runtime import launcher

    def fail(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(CpuMeter, "start", fail)
    assert launcher._cpu_meter(quiet=False) is None
    assert "psar: no cpu.json: can't start new thread" in capsys.readouterr().err


def _run(tmp_path, steps=4, step_s=1.0, idle=0.05, **summary):
    """A run of 2 cores whose steps (100 s on) keep them 60% at user, 10% in the kernel, 20%
    in soft interrupts, 5% stolen and `idle` idle or waiting on I/O (half each; taken from
    user's share); before the steps, 100% user (start-up)."""
    (tmp_path / "metrics").mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "summary.json").write_text(json.dumps({"engine": "ps-sync", "workers": 1, "servers": 1, **summary}))
    walls = [100.0 + step_s * k for k in range(steps + 1)]
    (tmp_path / "metrics" / "rank0.jsonl").write_text(
        "".join(json.dumps({"step": k, "wall": w, "time": w - 99.5}) + "\n" for k, w in enumerate(walls)))
    t = [90.0 + 0.05 * i for i in range(int((walls[-1] + 1 - 90.0) / 0.05) + 1)]
    hz = 2 * 100  # ticks a second, both cores

    def ticks(share_in_steps, share_before):
        return [round(hz * (share_before * min(x, 100.0) - share_before * 90.0
                            + share_in_steps * max(0.0, x - 100.0))) for x in t]
    data = {"interval_s": 0.05, "t": t, "cores": 2,
            "ticks": {"user": ticks(0.65 - idle, 1.0), "nice": [0] * len(t), "system": ticks(0.1, 0.0),
                      "idle": ticks(idle / 2, 0.0), "iowait": ticks(idle / 2, 0.0), "irq": [0] * len(t),
                      "softirq": ticks(0.2, 0.0), "steal": ticks(0.05, 0.0)}}
    (tmp_path / CPU_FILE).write_text(json.dumps(data))
    return load_run(tmp_path)


def test_the_cores_shares_are_those_of_the_steps_alone(tmp_path):
    found = host_cpu(_run(tmp_path))
    assert found["steps"] == 4 and found["cores"] == 2  # steps 1-4, from the end of each before
    assert found["busy"] == pytest.approx(0.9, abs=0.01)  # start-up's 100% left out
    assert found["user"] == pytest.approx(0.6, abs=0.01) and found["softirq"] == pytest.approx(0.2, abs=0.01)
    assert found["steal"] == pytest.approx(0.05, abs=0.01) and found["idle"] == pytest.approx(0.05, abs=0.01)
    assert found["used"] == pytest.approx(found["busy"] + found["steal"]) == pytest.approx(0.95, abs=0.01)
    assert host_used(_run(tmp_path)) == found["used"] >= SATURATED
    text = line(_run(tmp_path))
    assert text.startswith("host: 2 cores, 5% idle over 4 steps (user 60%, system 10%, softirq 20%, steal 5%)")
    assert "saturated" in text


def test_a_run_without_a_timeline_has_none_and_a_broken_one_is_named(tmp_path):
    run = _run(tmp_path)
    (tmp_path / CPU_FILE).write_text(json.dumps({"t": [1.0, 2.0], "cores": 2, "ticks": {"user": [0]}}))
    with pytest.raises(ValueError, match=CPU_FILE):
        host_cpu(run)
    (tmp_path / CPU_FILE).unlink()
    assert host_cpu(run) is None and host_used(run) is None and line(run) is None


def test_the_verdict_says_where_an_emulated_comparisons_cores_were_saturated(tmp_path):
    from analysis.verdict import verdicts

    def pair(where, idle, network):
        common = dict(workers=2, experiment="quickstart", final_loss=1.0, eval={}, bytes_per_worker_per_step=1e6,
                      network=network)
        return [_run(where / "ar", idle=idle, engine="allreduce", samples_per_sec=100.0, **common),
                _run(where / "ps", idle=idle, engine="ps-sync", samples_per_sec=80.0, **common)]

    net = {"rate": "100mbit", "rate_bits": 1e8}
    (line,) = verdicts(pair(tmp_path / "busy", 0.02, net))
    assert line.startswith("verdict, 2 workers on 100mbit: allreduce/library fastest")
    assert "in 2 of these 2 runs the host's cores were 90% in use or more through the steps (up to 98%)" in line
    assert "on a cluster" in line
    mixed = pair(tmp_path / "mixed", 0.3, net)[:1] + pair(tmp_path / "mixed2", 0.02, net)[1:]
    assert "in 1 of these 2 runs" in verdicts(mixed)[0]
    assert "cores" not in verdicts(pair(tmp_path / "idle", 0.3, net))[0]  # 70% in use: the links decided
    assert "cores" not in verdicts(pair(tmp_path / "loopback", 0.02, None))[0]  # loopback: said apart


def _proc_stat(pid: int, utime: int, stime: int, start: int, comm: str = "python") -> str:
    fields = ["S", 1, pid, pid, 0, -1, 0, 0, 0, 0, 0, utime, stime, 0, 0, 20, 0, 1, 0, start]
    return f"{pid} ({comm}) " + " ".join(map(str, fields)) + " 0 0\n"


def test_a_process_stat_gives_its_cpu_ticks_and_start_whatever_its_name():
    assert read_process(_proc_stat(7, 30, 12, 555)) == (42, 555)
    assert read_process(_proc_stat(7, 30, 12, 555, comm="a) b (c")) == (42, 555)  # the name may hold ')'
    with pytest.raises(ValueError, match="utime"):
        read_process("7 (python) S 1 2")


def test_the_meter_counts_each_watched_process_and_a_restarted_one_goes_on(tmp_path):
    proc = tmp_path / "proc"

    def write(pid, utime, start=100):
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "next").write_text(_proc_stat(pid, utime, 0, start))
        os.replace(tmp_path / "next", proc / str(pid) / "stat")

    def read_as(count, more=0):  # until the meter has read rank 0 at count, `more` readings on
        deadline, at = time.monotonic() + 10, readings()
        while time.monotonic() < deadline:
            seen = (meter.counts("ticks") or {"ticks": {}})["ticks"].get("process rank 0", [])
            if seen and seen[-1] == count and readings() >= at + more:
                return
            time.sleep(0.005)
        pytest.fail(f"the meter never read rank 0 at {count}")

    def readings():
        return len((meter.counts("ticks") or {"t": [0]})["t"])
    (tmp_path / "stat").write_text(_stat())
    write(11, 5)
    meter = CpuMeter(0.01, tmp_path / "stat", proc=proc).start()
    try:
        meter.watch("rank 0", 11)
        meter.watch("server 0", 99)  # gone before it was watched: not counted
        read_as(5)
        write(11, 25)
        read_as(25)
        (proc / "11" / "stat").unlink()  # rank 0 ended: its count stays, two readings on
        read_as(25, more=2)
        write(12, 0)
        meter.watch("rank 0", 12)  # started again: counts on from the first one's 25
        write(12, 10)
        read_as(35)
        write(12, 500, start=900)  # pid 12 taken by another process since: not rank 0's
        time.sleep(0.05)
    finally:
        meter.stop()
    out = meter.timeline()
    assert meter.error is None and set(out["processes"]) == {"rank 0"} and set(out["ticks"]) == set(STATES)
    counts = out["processes"]["rank 0"]
    assert len(counts) == len(out["t"]) and counts == sorted(counts) and out["ticks"]["user"][-1] == 0
    assert counts[0] == 0 and {5, 25} <= set(counts) and counts[-1] == 35  # the first reading was before the watch


def test_the_ranks_and_shards_cores_through_the_steps(tmp_path):
    run = _run(tmp_path)
    data = json.loads((tmp_path / CPU_FILE).read_text())

    def held(cores, before):  # ticks of a process holding `cores` in the steps, `before` earlier
        return [round(100 * (before * (min(x, 100.0) - 90.0) + cores * max(0.0, x - 100.0))) for x in data["t"]]
    data["processes"] = {"rank 0": held(0.5, 1.0), "rank 1": held(0.3, 0.0), "server 0": held(0.6, 0.0)}
    (tmp_path / CPU_FILE).write_text(json.dumps(data))
    found = host_cpu(run)
    assert found["ranks"] == pytest.approx(0.8, abs=0.01) and found["ranks_max"] == pytest.approx(0.5, abs=0.01)
    assert found["shards"] == pytest.approx(0.6, abs=0.01) == found["shards_max"]
    assert set(found["processes"]) == {"rank 0", "rank 1", "server 0"}
    assert "; ranks 0.80 cores (the busiest 0.50); shards 0.60 cores (the busiest 0.60)" in line(run)
    data["processes"] = {"rank 0": [0]}
    (tmp_path / CPU_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="processes"):
        host_cpu(run)


def test_a_meter_that_stops_reading_early_says_so_when_finished(tmp_path, capsys):
    path = tmp_path / "stat"
    path.write_text(_stat())
    meter = CpuMeter(0.01, path).start()
    deadline = time.monotonic() + 10
    while meter.counts("ticks") is None and time.monotonic() < deadline:  # two readings at least
        time.sleep(0.01)
    path.unlink()  # the counters gone mid-run: the readings so far stay
    deadline = time.monotonic() + 10
    while meter.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    out = meter.finish(CPU_FILE)
    assert out is not None and len(out["t"]) >= 2
    assert f"psar: {CPU_FILE} stops early: " in capsys.readouterr().err and "stat" in meter.error
    assert meter.finish(CPU_FILE, quiet=True) == out and capsys.readouterr().err == ""


def _with_processes(run, **cores):
    """run's cpu.json with processes holding `cores` each ({"rank_0": 0.5, "server_0": 0.95})
    through its steps (100 s on), none before."""
    path = run.path / CPU_FILE
    data = json.loads(path.read_text())
    data["processes"] = {name.replace("_", " "): [round(100 * c * max(0.0, x - 100.0)) for x in data["t"]]
                         for name, c in cores.items()}
    path.write_text(json.dumps(data))
    return load_run(run.path)


def test_a_shard_that_held_a_whole_core_is_said_where_the_cores_are_and_in_the_verdict(tmp_path):
    from analysis.verdict import verdicts

    common = dict(workers=2, experiment="quickstart", final_loss=1.0, eval={}, bytes_per_worker_per_step=1e6,
                  network=None)
    ring = _run(tmp_path / "ar", idle=0.3, engine="allreduce", samples_per_sec=100.0, **common)
    bound = _with_processes(_run(tmp_path / "ps", idle=0.3, engine="ps-sync", samples_per_sec=80.0, **common),
                            rank_0=0.3, rank_1=0.3, server_0=0.96)
    assert host_cpu(bound)["shards_max"] == pytest.approx(0.96, abs=0.01)
    assert "; a shard held a whole core: its message handling set the pace" in line(bound)
    (said,) = verdicts([_with_processes(ring, rank_0=0.4, rank_1=0.4), bound])
    assert "in 1 of these 1 parameter-server runs a shard process held 0.9 of a core or more" in said
    assert "(up to 0.96)" in said
    spare = _with_processes(bound, rank_0=0.3, rank_1=0.3, server_0=0.5)
    assert "whole core" not in line(spare) and "shard process" not in verdicts([ring, spare])[0]


@pytest.mark.timeout(60)
def test_the_cores_a_process_held_in_each_window_of_wall_clock_time():
    import subprocess
    import sys

    from experiments.runtime.cpumeter import cores_in_windows

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = time.time()
        windows = [(now - 5.0, now - 4.0), (now + 0.3, now + 1.3)]  # the first long past
        late, held = cores_in_windows([busy.pid, idle.pid], windows)
        assert late is None and 0.3 < held <= 1.1, held  # one thread spinning (shared on a busy machine)
        (alone,) = cores_in_windows([idle.pid], [(time.time() + 0.2, time.time() + 0.7)])
        assert alone is not None and alone < 0.1
        assert cores_in_windows([2 ** 22 + 7], [(time.time() + 0.1, time.time() + 0.3)]) == [None]  # no such pid
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
