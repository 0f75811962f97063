"""The held-back sends of psar's ring under an injected latency (allreduce.ring._LateSends):
each posted no sooner than the delay after it was asked for, in order, all of them by close();
after an error in the ring, none more; a post that fails is raised in the ring's thread."""

import time

import pytest

from allreduce.ring import _LateSends


def test_each_send_leaves_the_delay_after_it_was_asked_for_in_order_and_close_waits_for_all():
    posted = []
    late = _LateSends(0.05, lambda hop, j: posted.append((hop, j, time.monotonic())))
    asked = {}
    for hop, j in ((0, 0), (0, 1), (1, 0)):
        asked[hop, j] = time.monotonic()
        late.send(hop, j)
        time.sleep(0.01)
    assert posted == [] or all(t - asked[h, j] >= 0.05 for h, j, t in posted)  # none early
    late.close()
    assert [(h, j) for h, j, _ in posted] == [(0, 0), (0, 1), (1, 0)]
    assert all(t - asked[h, j] >= 0.05 for h, j, t in posted)


def test_after_an_error_in_the_ring_what_is_held_is_dropped():
    posted = []
    late = _LateSends(0.2, lambda hop, j: posted.append((hop, j)))
    late.send(0, 0)
    late.close(drop=True)
    assert posted == []


def test_a_failing_post_is_raised_by_the_next_send_or_by_close():
    def post(hop, j):
        raise ValueError(f"peer gone at hop {hop}")

    late = _LateSends(0.0, post)
    late.send(3, 0)
    deadline = time.monotonic() + 5
    while late.error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="held-back send failed: peer gone at hop 3"):
        late.send(4, 0)
    with pytest.raises(RuntimeError, match="peer gone at hop 3"):
        late.close()
