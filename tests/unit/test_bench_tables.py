"""`psar bench`'s all-reduce table from made-up rows: each algorithm's ratio to the library is
the paired one the benchmark measured, and the goal line reads the ring's cells."""

from __future__ import annotations

import pytest

from experiments.bench.suite import format_allreduce_table


def row(nbytes, algorithm, time_us, vs_library=None):
    out = {"bytes": nbytes, "algorithm": algorithm, "time_us": time_us, "algbw_gbs": nbytes / time_us / 1e3,
           "busbw_gbs": nbytes / time_us / 1e3}
    return out if vs_library is None else dict(out, vs_library=vs_library)


def test_the_table_gives_the_paired_ratio_and_the_goal_line():
    table = {"world": 2, "backend": "gloo", "rows": [
        row(1024, "library", 400.0), row(1024, "ring", 500.0, vs_library=0.8),
        row(4 << 20, "library", 3500.0), row(4 << 20, "ring", 4500.0, vs_library=0.81),
        row(64 << 20, "library", 50000.0), row(64 << 20, "ring", 48000.0, vs_library=1.04)]}
    text = format_allreduce_table(table)
    # the ratio printed is the measured pair's (0.81), not the ratio of the two medians (0.78)
    assert "0.81x" in text and "0.78x" not in text
    assert text.splitlines()[-1] == ("ring: 1 KiB in 1.25x the library's time (goal: at most 2); from 4 MiB "
                                     "0.81x to 1.04x its busbw (goal: at least 0.9)")


def test_no_algorithm_always_comes_first_or_after_the_same_one():
    from allreduce.benchmark import round_order

    algorithms = ["library", "ring", "tree", "auto"]
    orders = [round_order(algorithms, k) for k in range(6)]
    assert orders[:3] == [["library", "ring", "tree", "auto"], ["auto", "tree", "ring", "library"],
                          ["ring", "tree", "auto", "library"]]
    assert all(sorted(o) == sorted(algorithms) for o in orders)
    assert len({o[0] for o in orders}) >= 3
    for a in algorithms:  # each follows both its neighbours, or comes first, in some round
        assert len({o[o.index(a) - 1] if o.index(a) else None for o in orders}) >= 2


def test_a_round_takes_turns_in_blocks_each_after_a_barrier(monkeypatch):
    import types

    import torch

    import allreduce.benchmark as benchmark

    seen = []
    fake = types.SimpleNamespace(barrier=lambda: seen.append("|"), all_reduce=lambda t, op=None: None,
                                 ReduceOp=types.SimpleNamespace(MAX=None))
    monkeypatch.setattr(benchmark, "dist", fake)
    monkeypatch.setattr(benchmark, "run_algorithm", lambda a, *args, **kw: seen.append(a))
    took = benchmark._interleaved(["ring", "tree"], {"ring": 5, "tree": 2}, {"ring": 2, "tree": 1},
                                  torch.zeros(1), 0, 2, {}, "cpu")
    assert "".join(x[0] if x != "|" else "|" for x in seen) == "|rr|t|rr|t|r"
    assert set(took) == {"ring", "tree"} and all(v >= 0 for v in took.values())


def test_the_push_pull_table_ends_with_the_worst_ratio_of_each_goal_range():
    from experiments.bench.suite import format_ps_table

    def ps_row(nbytes, ratio):
        return {"bytes": nbytes, "zmq_us": 100.0, "zmq_gbs": 1.0, "ps_us": 100.0 / ratio, "ps_gbs": ratio,
                "ratio": ratio}

    rows = [ps_row(1 << 10, 0.42), ps_row(64 << 10, 0.55), ps_row(256 << 10, 0.1), ps_row(1 << 20, 0.83),
            ps_row(4 << 20, 0.79), ps_row(64 << 20, 0.9)]
    last = format_ps_table(rows).splitlines()[-1]
    assert last == ("push+pull / ZeroMQ, one at a time: 1 KiB to 64 KiB at least 0.42 (goal: 0.5); "
                    "1 MiB to 4 MiB at least 0.79 (goal: 0.8)")


def test_the_many_worker_rows_add_every_workers_bytes_each_way():
    from ps.benchmark import LOAD_SIZES, aggregate

    small, large = LOAD_SIZES
    counts = [{"zmq": {str(small): 100, str(large): 10}, "ps": {str(small): 50, str(large): 8}},
              {"zmq": {str(small): 300, str(large): 30}, "ps": {str(small): 150, str(large): 32}}]
    rows = aggregate(counts, phase_s=2.0)
    assert [r["bytes"] for r in rows] == list(LOAD_SIZES)
    assert rows[0]["zmq_gbs"] == 400 * 2 * small / 2.0 / 1e9 and rows[0]["ratio"] == 0.5
    assert rows[1]["ps_gbs"] == 40 * 2 * large / 2.0 / 1e9 and rows[1]["ratio"] == 1.0


def test_the_bench_measures_the_fabric_where_it_can_make_hosts_and_says_why_not_elsewhere(monkeypatch):
    """`psar bench` (as root) measures what its machine's emulated links carry at once, at the
    held-out grid's fastest rate, for `psar predict --validate --bench`; elsewhere it says why
    it did not."""
    from experiments.bench import fabric as machine
    from experiments.runtime import iproute

    said = []
    monkeypatch.setattr(iproute, "unavailable", lambda: "emulated networks need root")
    assert machine.fabric_if_possible(said.append) is None
    assert said == ["fabric: not measured (emulated networks need root)"]
    measured = {"hosts": 4, "rate": "2gbit", "seconds": [0.07, 0.08, 0.09], "bytes_per_s": 6.0e8}
    asked = []
    monkeypatch.setattr(iproute, "unavailable", lambda: None)
    monkeypatch.setattr(machine, "fabric", lambda rate: asked.append(rate) or measured)
    assert machine.fabric_if_possible(said.append) is measured and asked == ["2gbit"]
    assert said[-1].startswith("fabric: 4 emulated hosts on 2gbit links moved 600 MB/s all together")


def test_ps_sync_and_the_rpc_server_run_in_turn_and_each_pair_gives_a_ratio(monkeypatch, tmp_path):
    """The bench's rpc column: a ps-sync run, then an rpc server run, round after round, each
    in a folder of its own; the ratio is each pair's."""
    from experiments.bench import suite

    calls, ps, rpc = [], iter([300.0, 330.0, 360.0]), iter([200.0, 300.0, 180.0])

    def engines(experiment, variants, workers, steps, rounds, out):
        calls.append(("ps-sync", out.name, list(variants), rounds))
        return {"ps-sync": [next(ps)]}

    def server(experiment, workers, steps, rounds, out):
        assert out.is_dir()
        calls.append(("rpc", out.name, rounds))
        return [next(rpc)]

    monkeypatch.setattr(suite, "engine_throughput", engines)
    monkeypatch.setattr(suite, "rpc_throughput", server)
    pairs = suite.rpc_pairs("mlp-wide", 2, 15, 3, tmp_path)
    assert calls == [("ps-sync", "rpc-pair0", ["ps-sync"], 1), ("rpc", "rpc-pair0", 1),
                     ("ps-sync", "rpc-pair1", ["ps-sync"], 1), ("rpc", "rpc-pair1", 1),
                     ("ps-sync", "rpc-pair2", ["ps-sync"], 1), ("rpc", "rpc-pair2", 1)]
    assert pairs == {"ps_sync": [300.0, 330.0, 360.0], "rpc_ps": [200.0, 300.0, 180.0], "ratios": [1.5, 1.1, 2.0]}


def test_the_update_rows_time_sgd_and_count_the_cores_each_way(kernel_threads):
    """One row of each mode in this process (torch's threads restored after): the update's
    median and the cores held are measured; the thread counts span a share and the host."""
    import torch

    from experiments.bench.update_threads import format_update_threads_table, one_row, thread_counts
    from ps.shard import compiled
    from ps.shard.optim import compiled_sgd

    modes = ("torch", "slices") + (("kernel",) if compiled_sgd() is not None else ())
    before = torch.get_num_threads()
    try:
        rows = [one_row(mode, 2, 1 << 16, gap_s=0.001, count=20) for mode in modes]
        if "kernel" in modes:  # a key the kernel splits
            rows.append(one_row("kernel", 2, compiled.SPLIT_MIN_BYTES, gap_s=0.001, count=5))
    finally:
        torch.set_num_threads(before)
    for row, mode in zip(rows, modes):
        assert row["mode"] == mode and row["threads"] == 2 and row["bytes"] == 1 << 16
        assert 0 < row["update_us"] < 1e6 and 0 <= row["cores"] < 4
    table = format_update_threads_table(rows)
    assert "  64 KiB        2   torch       -" in table and "  64 KiB        2  slices       1" in table
    if "kernel" in modes:
        assert "  64 KiB        2  kernel       1" in table and "   3 MiB        2  kernel       2" in table
    assert thread_counts(16) == [2, 8, 16] and thread_counts(2) == [2] and thread_counts(3) == [2, 3]
    with pytest.raises(ValueError, match="mode 'omp'"):
        one_row("omp", 2, 1 << 16)


def test_the_shard_loop_times_each_rule_both_ways():
    """A few steps of each rule through a shard's handle() in this process: both paths time
    the same messages, none refused, and the compiled path (where built) takes all of them
    (its first momentum step, in the warm-up, is Python's)."""
    from experiments.bench.shard_loop import format_shard_loop, shard_loop
    from ps.shard import compiled

    rows = shard_loop(steps=10)
    assert [r["rule"] for r in rows] == ["sync", "async"]
    for r in rows:
        assert 0 < r["python_us"] < 1e6
        if compiled.available():
            assert 0 < r["compiled_us"] < 1e6 and r["compiled_share"] == 1.0
    table = format_shard_loop(rows)
    assert table.startswith("a shard's push+pull in one process") and "  sync   compiled " in table
