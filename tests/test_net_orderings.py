"""The shape of the results on a shaped network, as ratios of step times measured in one run
of this file: the ring's step grows as 2(N-1)/N, one separate shard's as N, k separate shards
divide the shard links' load by k. Link-bound runs of a small model (quickstart's MLP widened
to 1.2 MB of gradients, at 20 Mbit/s: about 0.5 s per gradient on a link).

Marked `long` (about 2 minutes): `make bench` runs it, `make test` does not. Needs root and
iproute2; skipped elsewhere, with the reason.
"""

from __future__ import annotations

import pytest

from analysis.costmodel import measured_step
from analysis.results import load_run
from experiments import network
from experiments.launcher import launch
from experiments.presets import build_config

REASON = network.unavailable()
pytestmark = [pytest.mark.long, pytest.mark.multiprocess, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")]

SETS = ("model.hidden=[512,512]", "net.rate=20mbit", "threads=1", "target_loss=0")
STEPS = 6


def step_s(tmp_path, engine: str, workers: int, servers: int = 1, *extra: str) -> float:
    cfg = build_config("quickstart", SETS + extra, engine=engine, workers=workers, servers=servers, steps=STEPS)
    run_dir = tmp_path / f"{engine}-w{workers}-s{servers}-{'-'.join(e.split('=')[1] for e in extra)}"
    launch(cfg, run_dir, deadline_s=600, quiet=True)
    return measured_step(load_run(run_dir))


def test_ring_and_one_shard_scale_as_their_links_say(tmp_path):
    ring2, ring4 = (step_s(tmp_path, "allreduce", n) for n in (2, 4))
    ps2, ps4 = (step_s(tmp_path, "ps-sync", n, 1, "net.placement=separate") for n in (2, 4))
    print(f"ring {ring2:.2f} -> {ring4:.2f} s, one separate shard {ps2:.2f} -> {ps4:.2f} s")
    assert 1.2 < ring4 / ring2 < 1.8   # 2(N-1)/N: 1 -> 1.5
    assert 1.6 < ps4 / ps2 < 2.4       # N: 2 -> 4
    assert ps2 > 1.6 * ring2           # push then pull of 2M on the shard's link, against M


def test_spare_shards_divide_the_shard_links_load(tmp_path):
    steps = {k: step_s(tmp_path, "ps-sync", 4, k, "net.placement=separate") for k in (1, 2, 4)}
    print(", ".join(f"{k} shard(s) {s:.2f} s" for k, s in steps.items()))
    assert 1.6 < steps[1] / steps[2] < 2.4  # N*M/k on each shard's link
    # Down to the workers' own links at k = N (2 in theory; 8 processes share 2 cores here,
    # and 1.39 was seen with the cores also busy with other work).
    assert 1.2 < steps[2] / steps[4] < 2.4
