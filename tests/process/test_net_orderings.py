"""The shape of the results on a shaped network, as ratios of step times measured in one run
of this file: the ring's step grows as 2(N-1)/N, one separate shard's as N, k separate shards
divide the shard links' load by k. Link-bound runs of a small model (quickstart's MLP widened
to 1.2 MB of gradients, at 20 Mbit/s: about 0.5 s per gradient on a link). And bare TCP, no
psar, between 2 hosts and among 4, against the link model's payload rate.

Marked `long` (about 2.5 minutes): `make bench` runs it, `make test` does not. Needs root and
iproute2; skipped elsewhere, with the reason.
"""

from __future__ import annotations

import pytest

from analysis.costmodel import measured_step
from analysis.results import load_run
from experiments.runtime import netns as network
from experiments.runtime.launcher import launch
from experiments.settings.presets import build_config

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


# A shard answers a key once every worker has pushed it: its first replies wait for N keys, and
# its last follow N keys after the last push. On this 1.2 MB model at 20mbit a default 0.5 MiB
# key makes that 0.9 s a step, as long as the bytes of 2 spare shards (s1/s2 was 1.57); keys
# of 128 KiB keep it below the bytes' time, as 0.5 MiB keys are on mlp-mid at 200mbit.
SMALL_KEYS = ("ps.chunk_mb=0.125", "ps.bucket_kb=128")


def test_spare_shards_divide_the_shard_links_load(tmp_path):
    steps = {k: step_s(tmp_path, "ps-sync", 4, k, "net.placement=separate", *SMALL_KEYS) for k in (1, 2, 4)}
    print(", ".join(f"{k} shard(s) {s:.2f} s" for k, s in steps.items()))
    assert 1.6 < steps[1] / steps[2] < 2.4  # N*M/k on each shard's link
    # Down to the workers' own links at k = N (2 in theory; 8 processes share 2 cores here,
    # and 1.39 was seen with the cores also busy with other work).
    assert 1.2 < steps[2] / steps[4] < 2.4


def test_bare_tcp_between_two_hosts_and_among_four(capsys):
    """Bare TCP on 200mbit links, no psar: each host sends 17.5 MB a round, to its one peer or
    split over 3 (the co-located parameter server's traffic). A pair runs within 15% of the
    bytes at the payload rate; the slowest of 4 is printed beside it (seen: 1.07 to 1.23 with
    one drop-tail queue where a host sends, 1.01 to 1.02 with its fair queueing)."""
    from analysis.linkmodel import PAYLOAD

    ratios = {}
    for n in (2, 4):
        per_peer = int(17.5e6 / (n - 1))
        ideal = per_peer * (n - 1) * 8 / (200e6 * PAYLOAD)
        with network.Network(tuple(f"h{i}" for i in range(n)), rate="200mbit") as net:
            rounds = [max(net.all_to_all(per_peer, 6100).values()) / ideal for _ in range(3)]
        ratios[n] = sorted(rounds)[1]
        with capsys.disabled():
            print(f"\n{n} hosts, each sending 17.5 MB over {n - 1} flow(s): slowest host "
                  f"{', '.join(f'{r:.2f}' for r in rounds)} times the bytes at the payload rate")
    assert ratios[2] < 1.15
    assert ratios[4] < 1.6
