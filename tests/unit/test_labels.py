"""Every run label every engine and setting can produce is known to the link model, the cost
model, the table, the figures and validation: no comparison loses its table to a label one
of them never heard of (`compare sparse` once trained 10 runs, then failed on
'allreduce/library+allgather')."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from allreduce.config import ALGORITHMS, SPARSE_MODES
from analysis import plots, style
from analysis.costmodel import CostModel, Fit, validate
from analysis.linkmodel import link_time, run_link_time
from analysis.results import family, load_run
from analysis.traffic import run_traffic
from analysis.table import rows
from experiments.engines import all_labels, engines

RATE_BITS = 200e6
M = 4 * 256 * 1024  # the fake model's float32 bytes


def fake_run(path, engine, workers=2, algorithm="library", sparse="dense", bytes_sent=None, recv=None,
             gathered=None, compute_s=0.1, step_s=0.5, samples_per_sec=100.0, experiment="toy", backups=0, stage=1,
             topology="ring"):
    """A run directory as psar writes one, on a 200mbit emulated network."""
    (path / "metrics").mkdir(parents=True)
    config = {"experiment": experiment, "engine": engine, "workers": workers, "servers": 2,
              "allreduce": {"algorithm": algorithm, "sparse": sparse}, "ps": {"backup_workers": backups},
              "zero": {"stage": stage}, "gossip": {"topology": topology},
              "net": {"rate": "200mbit"}}
    summary = {"experiment": experiment, "engine": engine, "workers": workers, "servers": 2, "steps": 4,
               "samples_per_sec": samples_per_sec, "final_loss": 1.0, "bytes_per_worker_per_step": M,
               "network": {"rate": "200mbit", "rate_bits": RATE_BITS, "placement": "separate"}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary))
    for rank in range(workers):
        record = {"compute_s": compute_s, "comm_s": step_s - compute_s, "step_s": step_s, "samples": 32,
                  "loss": 1.0, "bytes_sent": bytes_sent or 0, "bytes_recv": recv if recv is not None else bytes_sent or 0}
        if gathered is not None:
            record["gathered_bytes"] = gathered
        lines = [json.dumps({"step": i, "time": (i + 1) * step_s, **record}) for i in range(4)]
        (path / "metrics" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    torch.save({"w": torch.zeros(256, 1024)}, path / "model.pt")
    return load_run(path)


def every_variant(tmp_path):
    """One run per engine, per all-reduce algorithm and sparse mode, and ps-sync with backups."""
    runs = [fake_run(tmp_path / "ps-sync-backup", "ps-sync", bytes_sent=M, backups=1),
            fake_run(tmp_path / "zero-2", "zero", bytes_sent=M, stage=2),
            fake_run(tmp_path / "zero-3", "zero", bytes_sent=M, stage=3)]
    runs += [fake_run(tmp_path / f"gossip-{t}", "gossip", workers=4, bytes_sent=M, topology=t)
             for t in ("torus", "exponential", "one-peer-exponential", "complete")]
    for name in engines():
        settings = itertools.product(ALGORITHMS, SPARSE_MODES) if name == "allreduce" else [("library", "dense")]
        for algorithm, sparse in settings:
            gathered = 5000 if sparse == "allgather" else None
            runs.append(fake_run(tmp_path / f"{name}-{algorithm}-{sparse}", name, algorithm=algorithm, sparse=sparse,
                                 bytes_sent=M + (gathered or 0), gathered=gathered))
    return runs


def test_every_label_is_known_everywhere(tmp_path):
    runs = every_variant(tmp_path)
    labels = {run.label for run in runs}
    LABELS = all_labels()
    assert labels == set(LABELS)  # and no engine registers a label its runs never get
    model = CostModel(library=Fit(1e-4, 1e-9), ring=Fit(2e-4, 1e-9), ps=Fit(3e-4, 2e-9))
    for run in runs:
        assert style.colour(run.label) not in style.FALLBACK
        traffic = run_traffic(run)
        assert run_link_time(run, traffic) >= 0
        assert model.comm_time(run.label, 2, 2, traffic.push, 1, traffic.pull, traffic.gathered) >= 0
    table = rows(runs)
    assert {r["engine"].split(" every ")[0] for r in table} == set(LABELS)  # ps-easgd: "every 4", its tau
    assert all(r.get("theory_step_s") for r in table if r["engine"] != "local")
    assert {r["label"] for r in validate(model, runs)} == set(LABELS) - {"ddp"}  # inside backward: no T_c
    assert plots.plot_all(runs, tmp_path / "figures")
    with pytest.raises(ValueError, match="unknown engine label 'ps-magic'"):
        family("ps-magic")


def test_row_sparse_and_gathered_runs_are_modelled_by_their_bytes(tmp_path):
    """A ps run that pushed 10 kB of rows a step is not a 1 MB dense push; an all-gather's
    rows travel besides the all-reduced buckets."""
    rows_run = fake_run(tmp_path / "rows", "ps-sync", bytes_sent=10_000, recv=12_000)
    dense_run = fake_run(tmp_path / "dense", "ps-sync")  # nothing counted: the model's bytes
    assert (run_traffic(rows_run).push, run_traffic(rows_run).pull) == (10_000, 12_000)
    assert run_traffic(dense_run).push == M
    ideal = link_time("ps-sync", 2, 2, 12_000, RATE_BITS, "separate")  # the busier direction
    assert run_link_time(rows_run, run_traffic(rows_run)) == pytest.approx(ideal)
    assert run_link_time(rows_run, run_traffic(rows_run)) < run_link_time(dense_run, run_traffic(dense_run)) / 50

    gather = fake_run(tmp_path / "gather", "allreduce", sparse="allgather", bytes_sent=1000 + 7000, gathered=7000)
    traffic = run_traffic(gather)
    assert (traffic.push, traffic.gathered) == (1000, 7000)
    # 2 hosts: the ring's 2(N-1)/N M is M, and each host sends its gathered rows once
    assert run_link_time(gather, traffic) == pytest.approx(link_time("allreduce/library", 2, 1, 1000 + 7000, RATE_BITS))
    assert link_time("allreduce/library+allgather", 4, 1, 1000, RATE_BITS, gathered=7000) == pytest.approx(
        link_time("allreduce/library", 4, 1, 1000 + 7000 / 1.5, RATE_BITS))


def test_ddp_theory_takes_the_compute_of_the_all_reduce_runs_not_its_own(tmp_path):
    """ddp communicates inside backward: its step_s - comm_s holds the communication, which
    the theory would then count twice."""
    ddp = fake_run(tmp_path / "ddp", "ddp", compute_s=0.5, step_s=0.5)  # comm_s 0: all of it "compute"
    link = run_link_time(ddp, run_traffic(ddp))
    assert not [r for r in rows([ddp]) if r.get("theory_step_s")]  # nothing to take the compute from
    ring = fake_run(tmp_path / "ring", "allreduce", algorithm="ring", compute_s=0.1, step_s=0.5)
    (row,) = [r for r in rows([ddp, ring]) if r["engine"] == "ddp"]
    assert row["theory_step_s"] == pytest.approx(0.1 + link)


def test_a_speedup_above_the_worker_count_is_flagged(tmp_path):
    one = fake_run(tmp_path / "one", "allreduce", workers=1, samples_per_sec=100.0)
    fast = fake_run(tmp_path / "two", "allreduce", workers=2, samples_per_sec=500.0)
    table = rows([one, fast])
    (two,) = [r for r in table if r["workers"] == 2]
    assert two["speedup"] == 5.0 and "speed-up 5.0 above the 2 workers" in two["note"]
    fine = fake_run(tmp_path / "fine", "allreduce", workers=2, samples_per_sec=190.0)
    assert not [r for r in rows([one, fine]) if "speed-up" in (r["note"] or "")]
