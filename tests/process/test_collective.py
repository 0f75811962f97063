"""allreduce/collective.py: the two algorithms behind one handle. In one process over
stand-ins for the communication (what the handles do with the wire copy, the order and
errors of the ring's thread, the bytes each reports), and on two real Gloo ranks against the
float64 sum."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from allreduce import collective
from allreduce.collective import LibraryAllReduce, RingAllReduce, bus_bytes, make_collective
from spawn import run_ranks


@pytest.mark.parametrize("nbytes,world,expected", [
    (1000, 1, 0), (1000, 2, 1000), (1200, 3, 1600), (1000, 4, 1500), (0, 4, 0), (7, 2, 7), (10, 3, 13)])
def test_bus_bytes_is_2_n_minus_1_over_n(nbytes, world, expected):
    assert bus_bytes(nbytes, world) == expected


def test_make_collective_builds_each_algorithm_and_names_a_wrong_one():
    library, ring = make_collective("library", 1, 2), make_collective("ring", 1, 2, delay_s=0.5)
    assert isinstance(library, LibraryAllReduce) and isinstance(ring, RingAllReduce)
    assert (ring.rank, ring.world, ring.delay_s) == (1, 2, 0.5)
    library.close(), ring.close()
    tree = make_collective("tree", 0, 2)
    assert isinstance(tree, RingAllReduce) and tree.algorithm == "tree"
    tree.close()
    with pytest.raises(ValueError, match=r"allreduce.algorithm='star': expected library, ring, "
                                         r"halving-doubling, tree, hierarchical or auto"):
        make_collective("star", 0, 2)
    with pytest.raises(ValueError, match="hierarchical needs each rank's rack"):
        make_collective("hierarchical", 0, 2)
    hier = make_collective("hierarchical", 0, 2, racks=(0, 1))
    assert hier.racks == (0, 1)
    hier.close()


class FakeWork:
    """dist.Work of an all-reduce over `world` ranks that all hold the same tensor."""

    def __init__(self, tensor: torch.Tensor, world: int) -> None:
        self.tensor, self.world, self.waited = tensor, world, False
        self.future = torch.futures.Future()

    def wait(self) -> bool:
        self.tensor.mul_(self.world)
        self.waited = True
        self.future.set_result([self.tensor])
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


@pytest.fixture
def fake_all_reduce(monkeypatch):
    calls = []

    def all_reduce(tensor, async_op=False):
        calls.append(tensor)
        work = FakeWork(tensor, 2)
        if not async_op:
            work.wait()
            return None
        return work
    monkeypatch.setattr(collective.dist, "all_reduce", all_reduce)
    return calls


@pytest.mark.parametrize("dtype,wire,itemsize", [(torch.float64, None, 8), (torch.float64, torch.float32, 4),
                                                 (torch.float32, torch.float16, 2), (torch.float32, torch.float32, 4)])
def test_library_handle_reduces_on_the_wire_and_copies_back_in_place(fake_all_reduce, dtype, wire, itemsize):
    flat = torch.tensor([1.5, -2.25, 3.0, 0.125, 8.0, 1.0], dtype=dtype)
    traced = []
    algo = LibraryAllReduce(0, 4, trace=lambda *a, **k: traced.append((a, k)))
    handle, nbytes = algo.start(flat, wire, name="bucket 3")
    assert nbytes == bus_bytes(6 * itemsize, 4)  # what travels, in the wire dtype
    sent = fake_all_reduce[0]
    assert sent.dtype == (wire or dtype)
    assert (sent is flat) == (wire in (None, dtype))  # a copy only when the dtype changes
    assert torch.equal(flat, torch.tensor([1.5, -2.25, 3.0, 0.125, 8.0, 1.0], dtype=dtype))  # not yet
    handle.wait()
    assert flat.dtype == dtype
    assert torch.equal(flat, 2 * torch.tensor([1.5, -2.25, 3.0, 0.125, 8.0, 1.0], dtype=dtype))
    (name, begin, end), kwargs = traced[0]
    assert name == "bucket 3" and begin <= end and kwargs == {"thread": "comm"}


@pytest.mark.timeout(10)
def test_library_with_a_delay_starts_late_on_its_own_thread(fake_all_reduce):
    delay = 0.1
    traced = []
    algo = LibraryAllReduce(0, 3, trace=lambda *a, **k: traced.append((a, k)), delay_s=delay)
    flat = torch.ones(4, dtype=torch.float64)
    started = time.monotonic()
    handle, nbytes = algo.start(flat, torch.float32)
    assert time.monotonic() - started < delay  # start() does not wait out the delay
    assert nbytes == bus_bytes(16, 3)
    handle.wait()
    assert time.monotonic() - started >= 2 * (3 - 1) * delay  # 2(N-1) message delays
    assert torch.equal(flat, torch.full((4,), 2.0, dtype=torch.float64))
    algo.close()
    assert traced and traced[0][1] == {"thread": "comm"}


@pytest.mark.timeout(10)
def test_ring_buckets_run_one_at_a_time_in_launch_order_and_errors_reach_wait(monkeypatch):
    running, order, overlaps = [], [], []
    lock = threading.Lock()

    def ring(flat, rank, world, wire_dtype, delay_s=0.0):
        with lock:
            overlaps.append(bool(running))
            running.append(id(flat))
        time.sleep(0.01 * (5 - len(order)))  # earlier buckets take longer: order is not by speed
        order.append(int(flat[0]))
        with lock:
            running.remove(id(flat))
        if int(flat[0]) == 4:
            raise RuntimeError("Connection closed by peer")
        flat.add_(100)
        return 0, 0
    monkeypatch.setattr(collective, "ring_allreduce", ring)
    traced = []
    algo = RingAllReduce(0, 2, trace=lambda name, *a, **k: traced.append(name))
    flats = [torch.full((5,), float(i), dtype=torch.float64) for i in range(5)]
    started = [algo.start(f, None, name=f"b{i}") for i, f in enumerate(flats)]
    for i, (handle, nbytes) in enumerate(started[:4]):
        assert nbytes == bus_bytes(5 * 8, 2)
        handle.wait()
        assert torch.equal(flats[i], torch.full((5,), 100.0 + i, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # liveness turns it into a name
        started[4][0].wait()
    algo.close()
    assert order == [0, 1, 2, 3, 4] and not any(overlaps)
    assert traced == ["b0", "b1", "b2", "b3", "b4"]


@pytest.mark.parametrize("world,dtype,wire,expected", [
    (1, torch.float32, torch.float16, 0), (2, torch.float64, None, 48), (4, torch.float32, torch.float16, 18),
    (3, torch.float64, torch.float32, 32)])
def test_ring_reports_the_bytes_of_its_wire_dtype(monkeypatch, world, dtype, wire, expected):
    seen = []
    monkeypatch.setattr(collective, "ring_allreduce", lambda *a, **k: seen.append((a, k)) or (0, 0))
    algo = RingAllReduce(1 % world, world, delay_s=0.25)
    flat = torch.arange(6, dtype=dtype)
    handle, nbytes = algo.start(flat, wire)
    handle.wait()
    algo.close()
    assert nbytes == expected == bus_bytes(6 * (wire or dtype).itemsize, world)
    assert seen == [((flat, 1 % world, world, wire), {"delay_s": 0.25})]  # in place, with the delay


def test_ring_on_one_rank_leaves_the_values():
    algo = RingAllReduce(0, 1)
    flat = torch.arange(6, dtype=torch.float32)
    handle, nbytes = algo.start(flat, torch.float16)
    handle.wait()
    algo.close()
    assert nbytes == 0 and torch.equal(flat, torch.arange(6, dtype=torch.float32))


# -- two real ranks -------------------------------------------------------------------------------

LENGTHS = (1, 5, 1001)


def _values(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + numel), dtype=torch.float64)


def _reduce_every_way(rank, world):
    """Each algorithm, several buckets in flight at once, in float64 and on a float32 wire."""
    out = {}
    for algorithm in ("library", "ring"):
        for wire in (None, torch.float32):
            for delay in (0.0, 0.01):
                if delay and algorithm == "ring" and wire is not None:
                    continue
                algo = make_collective(algorithm, rank, world, delay_s=delay)
                flats = [_values(rank, n) for n in LENGTHS]
                handles = [algo.start(f, wire, name=f"b{n}") for f, n in zip(flats, LENGTHS)]
                for handle, _ in handles:
                    handle.wait()
                algo.close()
                out[f"{algorithm}/{wire}/{delay}"] = ([f.tolist() for f in flats], [n for _, n in handles])
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_both_algorithms_sum_over_two_gloo_ranks_as_float64_does():
    results = run_ranks(_reduce_every_way, 2, timeout_s=90)
    assert results[0].keys() == results[1].keys() and len(results[0]) == 7
    for way, (flats, nbytes) in results[0].items():
        wire = "float32" in way
        for n, got, other in zip(LENGTHS, flats, results[1][way][0]):
            expected = _values(0, n) + _values(1, n)  # the float64 reference
            got = torch.tensor(got, dtype=torch.float64)
            if wire:
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
                assert not torch.equal(got, expected) or n == 1  # it did travel in float32
            else:
                assert torch.equal(got, expected), way  # a + b: exact in float64
            assert got.tolist() == other, way  # both ranks hold the same values
        assert nbytes == [bus_bytes(n * (4 if wire else 8), 2) for n in LENGTHS], way
