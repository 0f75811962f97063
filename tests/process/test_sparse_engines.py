"""Embedding tables travel as the rows a batch touched: allreduce.sparse=allgather, and the
parameter server's push and pull by rows.

After 8 float64 steps of dlrm (two 512-row tables), local, allreduce with dense tables,
allreduce with all-gathered rows, and ps-sync by rows on 1 and 2 shards end with the same
parameters within 1e-10, under SGD and Adagrad, while the sparse paths move a fraction of
the dense bytes; rows can travel in fp16. The gather and merge are checked on three real Gloo
ranks, one of which touched no row.
"""

from __future__ import annotations

import pytest
import torch

from conftest import max_param_diff, max_rel_diff, run_jobs
from spawn import run_ranks

from allreduce.sparse import SparseAllGather, merge_rows
from experiments.settings.presets import build_config

ROWS, DIM, BATCH, WORLD = 512, 16, 32, 2
SMALL = (f"model.tables=[{ROWS},{ROWS}]", f"data.tables=[{ROWS},{ROWS}]", "data.samples=4000")
F64 = ("dtype=float64", "threads=1") + SMALL
OPTIMIZERS = {"sgd": ("optim.name=sgd", "optim.momentum=0"), "adagrad": ("optim.name=adagrad",)}
MODES = ("dense", "allgather")
SHARDS = (1, 2)


def POOL_JOBS() -> dict[str, dict]:
    jobs = {}
    for opt, extra in OPTIMIZERS.items():
        common = dict(experiment="dlrm", workers=WORLD, steps=8, batch_size=BATCH)
        jobs[f"{opt}-local"] = dict(common, engine="local", overrides=F64 + extra)
        for mode in MODES:
            jobs[f"{opt}-{mode}"] = dict(common, engine="allreduce",
                                         overrides=F64 + extra + (f"allreduce.sparse={mode}",))
        for servers in SHARDS:
            jobs[f"{opt}-ps{servers}"] = dict(common, engine="ps-sync", servers=servers,
                                              overrides=F64 + extra + ("ps.sparse=rows",))
    jobs["sgd-allgather-fp16"] = dict(jobs["sgd-allgather"], overrides=jobs["sgd-allgather"]["overrides"]
                                      + ("allreduce.compression=fp16",))
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_float64_allgather_matches_local_and_dense(results, opt):
    _, ref = results[f"{opt}-local"]
    for mode in MODES + tuple(f"ps{n}" for n in SHARDS):
        summary, state = results[f"{opt}-{mode}"]
        assert summary["steps"] == 8 and summary["workers"] == WORLD
        assert max_param_diff(ref, state) < 1e-10, mode
    # Training moved some table rows and left others, so the equality is not the trivial kind.
    cfg = build_config("dlrm", F64 + OPTIMIZERS[opt])
    torch.manual_seed(cfg.seed)
    initial = cfg.model.build().to(dtype=torch.float64).state_dict()
    moved = (ref["tables.0.weight"] != initial["tables.0.weight"]).any(dim=1)
    assert 0 < moved.sum() < ROWS


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_allgather_moves_a_fraction_of_the_dense_bytes(results, opt):
    dense = results[f"{opt}-dense"][0]["bytes_per_worker_per_step"]
    gathered = results[f"{opt}-allgather"][0]["bytes_per_worker_per_step"]
    assert gathered / dense < 0.25
    # What all-gather saves is the two tables' all-reduce (with two workers, bus bytes = the
    # table's bytes each way) less its own messages: at most BATCH ids and rows per table,
    # padded, plus the counts.
    tables = 2 * ROWS * DIM * 8
    most_gathered = 2 * BATCH * (8 + DIM * 8) + 2 * 8
    saved = (dense - gathered) / 2  # bytes_per_worker_per_step counts sent plus received
    assert tables - most_gathered <= saved < tables


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers", SHARDS)
def test_ps_rows_move_a_fraction_of_the_dense_bytes(results, servers):
    summary = results[f"adagrad-ps{servers}"][0]
    dense = results["adagrad-dense"][0]["bytes_per_worker_per_step"]
    assert summary["bytes_per_worker_per_step"] / dense < 0.25
    stats = summary["server_stats"]
    assert len(stats) == servers
    # Every step each worker pushes at most BATCH rows per table, and pulls as many.
    pushed = sum(s["rows_pushed"] for s in stats)
    assert 8 * WORLD * 2 <= pushed <= 8 * WORLD * 2 * BATCH
    assert sum(s["rows_pulled"] for s in stats) >= pushed
    # Rank 0 asked for each step's rows of both tables during the step before, but the first.
    assert summary["row_pulls"] == {"prefetched": 7 * 2, "at_lookup": 2}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_allgather_rows_can_travel_in_fp16(results):
    # (Adagrad is left out: its first step is lr * sign(g), so a row that rounds to zero in
    # fp16 moves by lr or not at all, dense or gathered alike.)
    summary, state = results["sgd-allgather-fp16"]
    assert 0 < max_rel_diff(results["sgd-local"][1], state) < 1e-3
    assert summary["bytes_per_worker_per_step"] < results["sgd-allgather"][0]["bytes_per_worker_per_step"]


@pytest.mark.timeout(60)
def test_allgather_refuses_an_optimizer_that_moves_untouched_rows():
    cfg = build_config("dlrm", SMALL + ("optim.name=sgd", "optim.momentum=0.9",
                                        "allreduce.sparse=allgather"), engine="allreduce")
    with pytest.raises(ValueError, match="allreduce.sparse=allgather: optim.name=sgd with momentum=0.9"):
        cfg.sparse_tables(cfg.model.build())
    assert build_config("dlrm", SMALL, engine="allreduce").sparse_tables(cfg.model.build()) == {}


def test_merge_sums_ids_shared_by_ranks_and_skips_a_rank_without_rows():
    ids = [torch.tensor([1, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 3])]
    rows = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.empty(0, 2), torch.tensor([[5.0, 6.0], [7.0, 8.0]])]
    merged = merge_rows(ids, rows, torch.Size([5, 2]))
    assert merged.is_coalesced()
    assert merged.indices().tolist() == [[0, 1, 3]]
    assert merged.to_dense().tolist() == [[5, 6], [1, 2], [0, 0], [10, 12], [0, 0]]
    none = torch.tensor([], dtype=torch.int64)
    nothing = merge_rows([none, none], [torch.empty(0, 2)] * 2, torch.Size([5, 2]))
    assert nothing._nnz() == 0 and nothing.shape == (5, 2)


# Rank 2 looks up nothing, so its table gets no gradient at all.
LOOKUPS = {0: [1, 3, 3], 1: [3, 7], 2: []}


def _gather_on_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    table = torch.nn.Embedding(10, 2).double()
    idle = torch.nn.Embedding(4, 2).double()  # touched by no rank: the gathers are skipped
    half = torch.nn.Embedding(10, 2).double()
    out = {}
    for name, modules, compression in (("exact", {"t": table, "idle": idle}, "none"),
                                       ("fp16", {"t": half}, "fp16")):
        gather = SparseAllGather(modules, world, compression)
        module = modules["t"]
        if LOOKUPS[rank]:
            weights = torch.arange(1.0, 1 + 2 * len(LOOKUPS[rank]), dtype=torch.float64) / 3
            (module(torch.tensor(LOOKUPS[rank])) * weights.view(-1, 2)).sum().backward()
            assert module.weight.grad.is_sparse
        out[f"{name}_bytes"] = gather.reduce()
        out[name] = module.weight.grad.to_dense().tolist()
        out[f"{name}_ids"] = module.weight.grad.indices()[0].tolist()
        if name == "exact":
            out["idle_nnz"] = idle.weight.grad._nnz()
        gather.zero_grad()
        out[f"{name}_cleared"] = module.weight.grad is None
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_gathered_rows_are_the_mean_of_every_ranks_rows():
    results = run_ranks(_gather_on_ranks, 3, timeout_s=90)
    expected = torch.zeros(10, 2, dtype=torch.float64)
    for rank, ids in LOOKUPS.items():
        weights = torch.arange(1.0, 1 + 2 * len(ids), dtype=torch.float64).view(-1, 2) / 3
        for i, row in zip(ids, weights):
            expected[i] += row / 3
    for out in results:
        assert out["exact"] == results[0]["exact"]  # every rank, bit for bit
        assert torch.allclose(torch.tensor(out["exact"], dtype=torch.float64), expected, rtol=1e-12, atol=0)
        assert out["exact_ids"] == [1, 3, 7] and out["idle_nnz"] == 0
        assert torch.allclose(torch.tensor(out["fp16"], dtype=torch.float64), expected, rtol=1e-3, atol=0)
        assert out["exact_cleared"] and out["fp16_cleared"]
    # Counts of two tables, then 2 padded ids and rows of the touched one, to each of 2 peers.
    assert [out["exact_bytes"] for out in results] == [2 * (2 * 8 + 2 * (8 + 2 * 8))] * 3
    assert [out["fp16_bytes"] for out in results] == [2 * (8 + 2 * (8 + 2 * 2))] * 3


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allgather_matches_cpu_in_float64(tmp_path):
    # NCCL cannot put two ranks on one GPU: one worker, which still gathers through NCCL.
    common = dict(experiment="dlrm", workers=1, steps=8, batch_size=BATCH)
    extra = ("dtype=float64",) + SMALL + OPTIMIZERS["adagrad"]
    results = run_jobs(tmp_path, {
        "cpu": dict(common, engine="local", overrides=extra),
        "cuda": dict(common, engine="allreduce",
                     overrides=extra + ("device=cuda", "allreduce.sparse=allgather")),
    })
    assert max_param_diff(results["cpu"][1], results["cuda"][1]) < 1e-8
