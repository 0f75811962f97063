"""The alpha-beta cost model: fits, communication times, validation on run directories, plots."""

from __future__ import annotations

import json
import math

import pytest
import torch

from analysis.costmodel import (CostModel, Fit, bucket_count, compute_time, fit_allreduce, fit_ps,
                                fit_summary, format_validation, measured_step,
                                plot_scaling, scaling, shard_count, validate)
from analysis.traffic import gradient_bytes, push_messages, run_traffic, wire_bytes
from analysis.results import load_run

MIB = 2**20
SIZES = [1024 * 4**k for k in range(9)]  # 1 KiB .. 64 MiB, as psar bench
LIB, RING, PS = Fit(1e-4, 1e-9), Fit(2e-4, 2e-9), Fit(5e-5, 1e-9)
MODEL = CostModel(library=LIB, ring=RING, ps=PS)


def allreduce_table(world: int, fits: dict[str, Fit]) -> dict:
    steps = 2 * (world - 1)
    rows = [{"bytes": n, "algorithm": algo,
             "time_us": 1e6 * (steps * f.alpha_s + steps / world * n * f.beta_s_per_byte)}
            for n in SIZES for algo, f in fits.items()]
    return {"world": world, "backend": "gloo", "rows": rows}


def ps_rows(fit: Fit) -> list[dict]:
    return [{"bytes": n, "ps_us": 1e6 * (2 * fit.alpha_s + 2 * n * fit.beta_s_per_byte)} for n in SIZES]


# ---------------------------------------------------------------- fits

@pytest.mark.parametrize("world", [2, 4])
def test_fit_allreduce_recovers_alpha_beta(world):
    truth = {"library": Fit(4.5e-4, 1 / 1.1e9), "ring": Fit(8e-4, 1 / 0.75e9)}
    table = allreduce_table(world, truth)
    for algo, want in truth.items():
        got = fit_allreduce(table, algo)
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=1e-6)
        assert got.beta_s_per_byte == pytest.approx(want.beta_s_per_byte, rel=1e-6)
        assert got.rel_rms < 1e-9 and got.points == len(SIZES)


def test_fit_ps_recovers_alpha_beta():
    want = Fit(1.5e-4, 1 / 0.77e9)
    got = fit_ps(ps_rows(want))
    assert got.alpha_s == pytest.approx(want.alpha_s, rel=1e-6)
    assert got.beta_s_per_byte == pytest.approx(want.beta_s_per_byte, rel=1e-6)
    assert got.predict(MIB) == pytest.approx(want.predict(MIB), rel=1e-9)


def test_fit_never_negative():
    # Exact through both points would need alpha < 0: alpha is held at 0, beta refitted.
    got = fit_ps([{"bytes": 1000, "ps_us": 0.5}, {"bytes": 10**6, "ps_us": 1000.0}])
    assert got.alpha_s == 0.0 and got.beta_s_per_byte > 0


def test_small_sizes_count_as_much_as_large_ones():
    # 1/t weights: a latency-only error at 1 KiB must move alpha, not vanish under 64 MiB rows.
    rows = ps_rows(Fit(1e-4, 1e-9))
    rows[0] = dict(rows[0], ps_us=rows[0]["ps_us"] * 2)
    assert fit_ps(rows).alpha_s > 1.1e-4


@pytest.mark.parametrize("table,algo,match", [
    (allreduce_table(2, {"library": LIB}), "ring", "no rows for algorithm 'ring'"),
    ({"world": 2, "rows": [{"bytes": 1024, "algorithm": "ring", "time_us": 5.0}]}, "ring", "at least 2"),
    (allreduce_table(1, {"library": LIB}), "library", "world=1"),
])
def test_fit_allreduce_errors(table, algo, match):
    with pytest.raises(ValueError, match=match):
        fit_allreduce(table, algo)


def test_from_bench_and_summary(tmp_path):
    report = {"allreduce_table": allreduce_table(2, {"library": LIB, "ring": RING}),
              "ps_bandwidth": ps_rows(PS), "throughput": {}, "median": {}}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    model = CostModel.from_bench(tmp_path / "bench.json")
    for got, want in ((model.library, LIB), (model.ring, RING), (model.ps, PS)):
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=1e-6)
        assert got.beta_s_per_byte == pytest.approx(want.beta_s_per_byte, rel=1e-6)
    assert (model.world, model.backend) == (2, "gloo")
    text = fit_summary(model)
    assert "alpha 100.0 us, 1/beta 1.000 GB/s" in text and "alpha 200.0 us, 1/beta 0.500 GB/s" in text
    assert "alpha 50.0 us" in text


def test_from_bench_without_ps_rows(tmp_path):
    report = {"allreduce_table": allreduce_table(2, {"library": LIB})}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    model = CostModel.from_bench(tmp_path / "bench.json")
    assert model.ring is None and model.ps is None
    assert "no bench rows" in fit_summary(model)
    with pytest.raises(ValueError, match="no 'ps' fit for ps-sync"):
        model.comm_time("ps-sync", 2, 1, MIB)


# ---------------------------------------------------------------- communication time

COMM_CASES = [
    # label, N, S, M, B, expected seconds
    ("local", 8, 1, 1e6, 1, 0.0),
    ("ddp", 1, 1, 1e6, 3, 0.0),  # one worker: no ring steps
    ("ddp", 2, 1, 1e6, 1, 2 * 1e-4 + 1e6 * 1e-9),
    ("allreduce/library", 2, 1, 1e6, 3, 2 * 3 * 1e-4 + 1e6 * 1e-9),
    ("allreduce", 4, 1, 4e6, 2, 6 * 2 * 1e-4 + 1.5 * 4e6 * 1e-9),
    ("allreduce/ring", 8, 5, 8e6, 1, 14 * 2e-4 + 1.75 * 8e6 * 2e-9),  # S ignored
    ("allreduce/ring", 2, 1, 0.0, 4, 2 * 4 * 2e-4),
    ("ps-sync", 1, 1, 1e6, 1, 2 * 5e-5 + 2e6 * 1e-9),
    ("ps-async", 4, 4, 1e6, 7, 8 * 5e-5 + 2e6 * 1e-9),  # N = S: 2M per shard, but 2N messages; B ignored
    ("ps-ssp", 2, 4, 1e6, 1, 2 * 5e-5 + 2e6 * 1e-9),  # S > N: the worker's link
    ("ps-sync", 8, 2, 1e6, 1, 16 * 5e-5 + 8e6 * 1e-9),  # N > S: the shard's link, 2NM/S, 2N messages
]


@pytest.mark.parametrize("label,n,s,m,b,expected", COMM_CASES,
                         ids=[f"{c[0]}-N{c[1]}-S{c[2]}-B{c[4]}" for c in COMM_CASES])
def test_comm_time(label, n, s, m, b, expected):
    assert MODEL.comm_time(label, n, s, m, b) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert MODEL.predict_step(label, n, s, m, 0.25, b) == pytest.approx(0.25 + expected, rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 16, 1024])
@pytest.mark.parametrize("b", [1, 5])
def test_ring_latency_and_byte_terms(n, b):
    latency = MODEL.comm_time("allreduce/ring", n, 1, 0.0, b)
    assert latency == pytest.approx(2 * (n - 1) * b * RING.alpha_s, rel=1e-12)
    m = 64 * MIB
    bandwidth = MODEL.comm_time("allreduce/ring", n, 1, m, b) - latency
    assert bandwidth == pytest.approx(2 * (n - 1) / n * m * RING.beta_s_per_byte, rel=1e-9)


def test_ps_bottleneck_moves_to_shard_above_s():
    s, m = 4, 1e6
    worker = 2 * PS.alpha_s + 2 * m * PS.beta_s_per_byte
    for n in range(1, 13):
        shard = n * (2 * PS.alpha_s + 2 * m / s * PS.beta_s_per_byte)
        assert MODEL.comm_time("ps-sync", n, s, m) == pytest.approx(max(worker, shard), rel=1e-12)
    # the worker's link binds while the shards are lightly loaded, the shards beyond
    assert MODEL.comm_time("ps-sync", 2, s, m) == pytest.approx(worker)
    assert MODEL.comm_time("ps-sync", 12, s, m) > worker


@pytest.mark.parametrize("args,match", [
    (("carrier-pigeon", 2, 1, 1.0), "unknown engine label 'carrier-pigeon'"),
    (("ps-sync", 2, 0, 1.0), "servers=0"),
    (("allreduce/ring", 0, 1, 1.0), "workers=0"),
])
def test_comm_time_errors(args, match):
    with pytest.raises(ValueError, match=match):
        MODEL.comm_time(*args)


@pytest.mark.parametrize("m,cap,first,expected", [
    (0, 25, 1, 1),
    (MIB, 25, 1, 1),  # fits the first bucket
    (MIB + 1, 25, 1, 2),
    (25 * MIB, 25, 1, 2),
    (25 * MIB + 1, 25, 1, 3),
    (80_150_568, 25, 1, 5),  # mlp-wide in float32
    (3 * MIB, 1, 0.5, 4),
])
def test_bucket_count(m, cap, first, expected):
    assert bucket_count(m, cap, first) == expected


@pytest.mark.parametrize("setting,n,expected", [
    ("1", 64, 1), (3, 64, 3), ("N", 64, 64), ("N/4", 64, 16), ("N/4", 2, 1), ("N/8", 1, 1),
])
def test_shard_count(setting, n, expected):
    assert shard_count(setting, n) == expected


def test_shard_count_error():
    with pytest.raises(ValueError, match="'2N'"):
        shard_count("2N", 4)


# ---------------------------------------------------------------- validation on run directories

STATE_BYTES = 512 * 1024 * 4 + 16 * 4 + 16 * 4 + 8 * 8  # w, bn mean, bn var, b (float64)
STATE_FLOATS = 512 * 1024 + 16 + 16 + 8
# rank 0 then rank 1; step 0 (the slow first step) must be skipped
COMPUTE = ([9.0, 0.10, 0.12, 0.11], [9.0, 0.11, 0.13, 0.12])  # median after step 0: 0.115
STEP = ([9.0, 0.20, 0.22, 0.21], [9.0, 0.21, 0.23, 0.22])  # median after step 0: 0.215


def write_run(path, engine, workers=2, servers=1, algorithm="library", compression="none", method="none",
              sent=None):
    (path / "metrics").mkdir(parents=True)
    config = {"experiment": "toy", "engine": engine, "workers": workers, "servers": servers,
              "batch_size": 32, "dtype": "float32",
              "allreduce": {"algorithm": algorithm, "bucket_cap_mb": 1.0, "first_bucket_mb": 0.5,
                            "compression": compression},
              "compress": {"method": method}}
    summary = {"experiment": "toy", "engine": engine, "workers": workers, "servers": servers,
               "steps": 4, "samples_per_sec": 100.0, "final_loss": 1.0, "bytes_per_worker_per_step": 0}
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary))
    for rank in range(2):
        lines = [json.dumps({"step": i, "compute_s": c, "comm_s": s - c, "step_s": s, "samples": 32,
                             **({"bytes_sent": sent} if sent else {})})
                 for i, (c, s) in enumerate(zip(COMPUTE[rank], STEP[rank]))]
        (path / "metrics" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    state = {"w": torch.zeros(512, 1024), "bn.running_mean": torch.zeros(16),
             "bn.running_var": torch.ones(16), "bn.num_batches_tracked": torch.tensor(3),
             "b": torch.zeros(8, dtype=torch.float64)}
    torch.save(state, path / "model.pt")
    return load_run(path)


def test_compressed_ring_runs_are_priced_by_what_they_sent(tmp_path):
    # top-k is all-gathered: each host sent its N-1 = 3 messages of 1000 bytes.
    gathered = run_traffic(write_run(tmp_path / "t", "allreduce", workers=4, method="topk", sent=3000))
    assert (gathered.push, gathered.gathered) == (0.0, 3000)
    # random-k adds up and is all-reduced: 2(N-1)/N of M = 1000 bytes is 1500.
    reduced = run_traffic(write_run(tmp_path / "r", "allreduce", workers=4, method="randomk", sent=1500))
    assert (reduced.push, reduced.gathered) == (1000, 0.0)


def test_run_quantities(tmp_path):
    run = write_run(tmp_path / "r", "allreduce", algorithm="ring")
    assert run.label == "allreduce/ring"
    assert gradient_bytes(run) == STATE_BYTES  # floating tensors only, not num_batches_tracked
    assert wire_bytes(run) == STATE_BYTES
    assert compute_time(run) == pytest.approx(0.115)
    assert measured_step(run) == pytest.approx(0.215)
    compressed = write_run(tmp_path / "c", "allreduce", compression="fp16")
    assert wire_bytes(compressed) == 2 * STATE_FLOATS


def test_push_messages_follow_backward_the_keys_and_the_bucket_size(tmp_path):
    # Last parameter first (b, 64 bytes) joins w's first key: w (2 MiB) is cut into 4 keys of
    # 512 KiB (ps.chunk_mb=0 on 1gbit links), and a 512 KiB bucket leaves between them. The
    # BatchNorm statistics are buffers, never pushed. bucket_kb=0: a message per key; 4096:
    # one in all. Without a link rate the keys are 4 MiB: w is one.
    run = write_run(tmp_path / "r", "ps-sync")
    k, b = 512 * 1024, 8 * 8
    config = json.loads((run.path / "config.json").read_text())
    assert push_messages(run) == [b + 4 * k]
    config["net"] = {"rate": "1gbit"}
    (run.path / "config.json").write_text(json.dumps(config))
    assert push_messages(load_run(run.path)) == [b + k, k, k, k]
    config["ps"] = {"bucket_kb": 0}
    (run.path / "config.json").write_text(json.dumps(config))
    assert push_messages(load_run(run.path)) == [b, k, k, k, k]
    config["ps"] = {"bucket_kb": 4096}
    (run.path / "config.json").write_text(json.dumps(config))
    assert push_messages(load_run(run.path)) == [b + 4 * k]
    config["ps"] = {"bucket_kb": 1024, "chunk_mb": 4}
    (run.path / "config.json").write_text(json.dumps(config))
    assert push_messages(load_run(run.path)) == [b + 4 * k]
    # The run's summary records its cut: the same one, or another that model.pt cannot tell.
    from ps.layout import ParamSpec, build_layout, chunk_elems_from_mb
    cut = build_layout([ParamSpec("0", (512, 1024), "float32"), ParamSpec("1", (8,), "float64")], 1,
                       chunk_elems_from_mb(4, 4)).cut
    summary = json.loads((run.path / "summary.json").read_text())
    for recorded, expected in ((cut, [b + 4 * k]), ("0" * 64, None)):
        summary["layout"] = {"keys": 2, "cut": recorded}
        (run.path / "summary.json").write_text(json.dumps(summary))
        assert push_messages(load_run(run.path)) == expected


def test_validate(tmp_path):
    runs = [write_run(tmp_path / "ring", "allreduce", algorithm="ring"),
            write_run(tmp_path / "ps", "ps-sync", servers=1),
            write_run(tmp_path / "local", "local")]
    m = STATE_BYTES
    buckets = math.ceil(m / MIB) + 1  # 1 MiB cap, plus the 0.5 MiB first bucket
    assert buckets == 4
    # A model whose ring is 100x slower than the test's constants makes one run miss by > 25%.
    model = CostModel(library=LIB, ring=Fit(2e-4, 2e-8), ps=PS)
    expected = {
        "allreduce/ring": 0.115 + 2 * buckets * 2e-4 + m * 2e-8,
        "ps-sync": 0.115 + 4 * 5e-5 + 4 * m * 1e-9,  # N=2 > S=1: the shard serves 2 rounds of 2M
        "local": 0.115,
    }
    rows = validate(model, runs)
    assert [r["label"] for r in rows] == ["allreduce/ring", "local", "ps-sync"]
    for row in rows:
        assert row["predicted_s"] == pytest.approx(expected[row["label"]], rel=1e-9)
        assert row["measured_s"] == pytest.approx(0.215)
        assert row["error"] == pytest.approx(expected[row["label"]] / 0.215 - 1, rel=1e-9)
        assert row["M_MB"] == pytest.approx(m / 1e6)
        assert row["workers"] == 2 and row["compute_s"] == pytest.approx(0.115)
    by_label = {r["label"]: r for r in rows}
    assert by_label["ps-sync"]["servers"] == 1 and by_label["local"]["servers"] is None
    assert by_label["allreduce/ring"]["buckets"] == 4
    text = format_validation(rows)
    # ring: 0.115 + 0.0016 + 0.042 = 0.159, -26%; ps-sync: 0.1235, -43%; local: -47%
    assert text.splitlines()[-1] == "within 25%: 0 of 3 runs"
    assert format_validation(rows, tolerance=0.3).splitlines()[-1] == "within 30%: 1 of 3 runs"
    assert f"{by_label['allreduce/ring']['error']:+.1%}" == "-26.3%" and "-26.3%" in text


# ---------------------------------------------------------------- scaling

def test_scaling_rows():
    rows = scaling(MODEL, 80e6, 0.2, 64, workers=(1, 2, 8))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    assert settings == ["allreduce/ring", "ps S=1", "ps S=N/4", "ps S=N"]
    row = next(r for r in rows if r["setting"] == "ps S=N/4" and r["workers"] == 8)
    assert row["servers"] == 2
    assert row["step_s"] == pytest.approx(0.2 + MODEL.comm_time("ps-sync", 8, 2, 80e6))
    assert row["samples_per_sec"] == pytest.approx(8 * 64 / row["step_s"])
    ring1 = next(r for r in rows if r["setting"] == "allreduce/ring" and r["workers"] == 1)
    assert ring1["step_s"] == 0.2 and ring1["servers"] is None


def test_plot_scaling(tmp_path):
    rows = scaling(MODEL, 80e6, 0.2, 64, workers=(1, 2, 4, 8, 16))
    paths = plot_scaling(rows, tmp_path / "plots")
    assert [p.name for p in paths] == ["model_step_time.png", "model_throughput.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
