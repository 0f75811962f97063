"""Soak: 16 worker threads, each with its own PSClient, push and pull against two ps-sync
shards over tcp://127.0.0.1 for a bounded time, and every update is applied exactly once.
About 7 s on 2 cores (PSAR_SOAK_SECONDS, default 5, sets the training part).

Worker w pushes the constant w + 1 every step with SGD lr=1.0 on float64, so after T steps
every value is init - T * mean(1..16) = init - 8.5 T exactly (init holds multiples of 1/4).
Pushes per second go to stdout and, if PSAR_SOAK_REPORT names a file, to that JSON file.
"""

import json
import os
import threading
import time

import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, join_values, split_values
from ps.local import LocalCluster

SPECS = [ParamSpec("w", (40, 50), "float64"), ParamSpec("b", (50,), "float64"), ParamSpec("v", (300,), "float64")]
LAYOUT = build_layout(SPECS, 2, 512)  # w is cut into 4 chunks of 500 over both shards
WORKERS = 16
SECONDS = float(os.environ.get("PSAR_SOAK_SECONDS", "5"))
MAX_STEPS = 2000
MEAN = sum(w + 1 for w in range(WORKERS)) / WORKERS  # 8.5: exact in float64
CONFIG = PSConfig(timeout_s=30.0, heartbeat_s=0.5, worker_timeout_s=20.0)
CLIENT_TIMEOUT_S = 15.0  # a stuck step fails in seconds, well inside the test's timeout


def init_params():
    return [torch.arange(s.numel, dtype=torch.float64).reshape(s.shape) * 0.25 - 100.0 for s in SPECS]


class Steps:
    """How many steps every worker does: MAX_STEPS, cut short once time is up.

    A worker asks may_start(step) before each step. stop() then lets every worker finish the
    last step any of them started, and none start another: all end on the same step T, as
    sync training needs (a worker that stopped early would leave the others waiting)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.target, self._started = MAX_STEPS, -1

    def may_start(self, step):
        with self._lock:
            if step >= self.target:
                return False
            self._started = max(self._started, step)
            return True

    def stop(self):
        with self._lock:
            self.target = min(self.target, self._started + 1)
            return self.target


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sixteen_workers_every_update_applied_exactly_once():
    init = init_params()
    flat_init = torch.cat([p.reshape(-1) for p in init])
    steps, errors = Steps(), []
    seen = {}  # worker -> last version it pulled
    ready = threading.Barrier(WORKERS + 1, timeout=30)
    with LocalCluster(LAYOUT, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", WORKERS, CONFIG,
                      address="tcp") as cluster:
        clients = [cluster.client(w, timeout_s=CLIENT_TIMEOUT_S) for w in range(WORKERS)]

        def worker(w):
            c = clients[w]
            try:
                _, step, _ = c.join()
                grads = split_values(LAYOUT, [torch.full(s.shape, float(w + 1), dtype=torch.float64) for s in SPECS])
                ready.wait()
                while steps.may_start(step):
                    push = c.push(step, step, grads)
                    pull = c.pull(min_version=step + 1)  # in flight with the push
                    c.wait(push)
                    result = c.wait(pull)
                    step += 1
                    # nobody can be a step further: that needs this worker's next push
                    assert result.versions == {0: step, 1: step}, (w, step, result.versions)
                    got = torch.cat([p.reshape(-1) for p in join_values(LAYOUT, result.values)])
                    assert torch.equal(got, flat_init - step * MEAN), (w, step)
                    seen[w] = result.version
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append((w, e))
                steps.stop()
                try:
                    ready.abort()
                except threading.BrokenBarrierError:
                    pass

        threads = [threading.Thread(target=worker, args=(w,), name=f"soak-{w}", daemon=True) for w in range(WORKERS)]
        try:
            for t in threads:
                t.start()
            try:
                ready.wait()
            except threading.BrokenBarrierError:
                raise AssertionError(f"a worker could not start: {errors}") from None
            start = time.monotonic()
            deadline = start + SECONDS
            for t in threads:  # until time is up, or every worker has done MAX_STEPS
                t.join(max(0.0, deadline - time.monotonic()))
            T = steps.stop()
            for t in threads:
                t.join(CLIENT_TIMEOUT_S + 5)
            elapsed = time.monotonic() - start
            assert not errors, errors[0]
            assert not any(t.is_alive() for t in threads), "a worker thread hung"

            stats = clients[0].stats()
            _, values = clients[0].checkpoint()
            for c in clients:
                c.leave()
        finally:
            for c in clients:
                c.close()
        assert cluster.join(10.0) and cluster.results == {0: "finished", 1: "finished"}

    assert T >= 1 and seen == {w: T for w in range(WORKERS)}
    for s in stats:
        assert (s["version"], s["updates"], s["pushes"]) == (T, T, WORKERS * T), s
        assert s["malformed"] == s["rejected"] == 0 and not s["lost_workers"] and s["aborted"] is None
    final = join_values(LAYOUT, values)
    for got, start_value in zip(final, init):
        assert torch.equal(got, start_value - T * MEAN)
    pushes = sum(s["pushes"] for s in stats)
    report = {"workers": WORKERS, "shards": LAYOUT.num_shards, "steps": T, "seconds": round(elapsed, 3),
              "pushes": pushes, "pushes_per_s": round(pushes / elapsed, 1),
              "worker_steps_per_s": round(WORKERS * T / elapsed, 1), "steps_per_s": round(T / elapsed, 2),
              "bytes_in": sum(s["bytes_in"] for s in stats)}
    print(f"\nsoak: {json.dumps(report)}")
    if os.environ.get("PSAR_SOAK_REPORT"):
        with open(os.environ["PSAR_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
