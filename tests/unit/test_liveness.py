"""allreduce/liveness.py in one process: a real TCPStore stands in for the process group's
store, and the test plays the peers, stamping their keys or not. The end-to-end check (a
worker killed mid-run, the survivor naming it) is test_process_loss.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from allreduce import liveness
from allreduce.liveness import KEY, Liveness, LostRank

INTERVAL_S = 0.05  # explain() then waits 4 intervals: 0.2 s


@pytest.fixture
def store(monkeypatch):
    """A TCPStore served by this process, handed to Liveness as the default group's store."""
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setattr(liveness.dist.distributed_c10d, "_get_default_store", lambda: master)
    yield master


class Peer:
    """Stamps rank `rank`'s key every interval while alive (as a live Liveness would)."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank, self.stop = store.clone(), rank, threading.Event()
        self.store.set(KEY.format(rank), repr(time.time()))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(INTERVAL_S / 2):
            self.store.set(KEY.format(self.rank), repr(time.time()))

    def die(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


@pytest.fixture
def peers():
    started = []
    yield lambda store, rank: started.append(Peer(store, rank)) or started[-1]
    for peer in started:
        peer.die()


@pytest.mark.timeout(10)
def test_stamps_advance_while_alive_and_stop_when_told(store):
    live = Liveness(0, 2, interval_s=INTERVAL_S)
    try:
        first = float(store.get(KEY.format(0)))  # stamped at once, before the first interval
        time.sleep(4 * INTERVAL_S)
        second = float(store.get(KEY.format(0)))
        assert second > first
        live.stop_stamping()
        assert live._thread is None
        stopped = store.get(KEY.format(0))
        time.sleep(3 * INTERVAL_S)
        assert store.get(KEY.format(0)) == stopped
        live.stop_stamping()  # twice is harmless
    finally:
        live.close()


@pytest.mark.timeout(10)
def test_a_silent_peer_is_named_with_the_collectives_first_line(store, peers):
    peers(store, 2)  # rank 2 stamps on; rank 1 stamped once, then went silent
    store.set(KEY.format(1), repr(time.time()))
    live = Liveness(0, 3, interval_s=INTERVAL_S)
    try:
        started = time.monotonic()
        message = live.explain(RuntimeError("Connection closed by peer [127.0.0.1]:123\nframe #0: ..."))
        waited = time.monotonic() - started
    finally:
        live.close()
    assert message.startswith("rank 1 is gone (no sign of life for 0.2 s)"), message
    assert "rank 2" not in message and "rank 0" not in message  # the live ones and itself are not blamed
    assert message.endswith("the collective failed with: Connection closed by peer [127.0.0.1]:123")
    assert 4 * INTERVAL_S <= waited < 4 * INTERVAL_S + 1.0  # it waits a few stamps, no more


@pytest.mark.timeout(10)
def test_peers_that_never_stamped_are_gone_too_and_named_together(store):
    live = Liveness(1, 3, interval_s=INTERVAL_S)  # ranks 0 and 2 never stamped at all
    try:
        message = live.explain(RuntimeError("timed out"))
    finally:
        live.close()
    assert message.startswith("rank 0, rank 2 are gone"), message
    assert "rank 1" not in message


@pytest.mark.timeout(10)
def test_every_rank_alive_says_so(store, peers):
    peers(store, 1)
    live = Liveness(0, 2, interval_s=INTERVAL_S)
    try:
        message = live.explain(RuntimeError("Gloo: message too long"))
    finally:
        live.close()
    assert message == "the collective failed but every rank is still alive: Gloo: message too long"


@pytest.mark.timeout(10)
def test_the_stores_host_gone_means_rank_0_is_gone(monkeypatch):
    host = [dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)]
    monkeypatch.setattr(liveness.dist.distributed_c10d, "_get_default_store", lambda: host[0])
    live = Liveness(1, 2, interval_s=INTERVAL_S)
    try:
        live.stop_stamping()
        host.clear()  # rank 0 hosts the store: its last reference gone, the server stops
        message = live.explain(RuntimeError("Connection reset by peer"))
    finally:
        live.close()
    assert message.startswith("rank 0 is gone: the rendezvous store it hosts no longer answers"), message
    assert message.endswith("(the collective failed with: Connection reset by peer)")


def test_without_a_store_the_peer_is_unnamed_and_nothing_stamps(monkeypatch):
    def no_group():
        raise ValueError("Default process group has not been initialized")
    monkeypatch.setattr(liveness.dist.distributed_c10d, "_get_default_store", no_group)
    live = Liveness(0, 2, interval_s=INTERVAL_S)
    assert live._thread is None
    assert live.explain(RuntimeError("broken pipe\nmore")) == "a peer was lost (broken pipe)"
    assert live.explain(RuntimeError("")) == "a peer was lost (RuntimeError)"  # no text: its type
    live.stop_stamping()
    live.close()


@pytest.mark.timeout(10)
def test_naming_lost_ranks_turns_a_failed_collective_into_lost_rank(store):
    live = Liveness(0, 2, interval_s=INTERVAL_S)  # rank 1 never stamped: it is gone
    try:
        with live.naming_lost_ranks():
            pass  # nothing failed: nothing raised
        for error in (RuntimeError("Connection closed by peer"), dist.DistError("Connection closed by peer")):
            with pytest.raises(LostRank, match=r"^rank 1 is gone .*Connection closed by peer$") as caught:
                with live.naming_lost_ranks():
                    raise error
            assert caught.value.__cause__ is error  # the collective's own error stays reachable
        # Not a communication error: it passes through untouched (and at once, no waiting).
        started = time.monotonic()
        with pytest.raises(ValueError, match="bad shape"):
            with live.naming_lost_ranks():
                raise ValueError("bad shape")
        assert time.monotonic() - started < 4 * INTERVAL_S  # explain() would have waited this long
    finally:
        live.close()


@pytest.mark.timeout(10)
def test_close_lets_go_of_the_store(store):
    live = Liveness(0, 2, interval_s=INTERVAL_S)
    live.close()
    assert live._store is None and live._thread is None
    assert live.explain(RuntimeError("x")) == "a peer was lost (x)"  # no store to ask any more
    stamp = store.get(KEY.format(0))
    time.sleep(3 * INTERVAL_S)
    assert store.get(KEY.format(0)) == stamp  # and it stamps no more
