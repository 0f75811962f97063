"""Our all-reduces post each receive ahead: Gloo sends a message only once the receiver has
posted its receive, so a receive posted only after the previous one arrived costs every hop a
round trip of notices. Checked without processes, on one rank whose messages a recorder takes
(what arrives is not the point here: tests/process/test_ring.py checks the sums)."""

from __future__ import annotations

import pytest
import torch

from allreduce import ring, steps, tree


class Recorder:
    """Stands in for Gloo's point-to-point messages: every post and every wait, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int]] = []

    def send(self, tensor, dst, group, tag):
        return self._post("send", dst, tag)

    def recv(self, tensor, src, group, tag):
        return self._post("recv", src, tag)

    def _post(self, kind: str, peer: int, tag: int):
        self.events.append(("post", kind, peer, tag))
        recorder = self

        class Work:
            def wait(self):
                recorder.events.append(("wait", kind, peer, tag))

            def is_completed(self):  # every other send has gone by the time the next is posted
                return kind == "send" and sum(e[0] == "post" for e in recorder.events) % 2 == 0
        return Work()

    def every_post_waited(self) -> bool:
        posts = sorted(e[1:] for e in self.events if e[0] == "post")
        return posts == sorted(e[1:] for e in self.events if e[0] == "wait")

    def posted_before_wait(self, later: tuple[str, int, int], earlier: tuple[str, int, int]) -> bool:
        """Whether `later` (kind, peer, tag) was posted before `earlier` was first waited on."""
        first_wait = self.events.index(("wait", *earlier))
        return ("post", *later) in self.events[:first_wait]


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(ring.P2P, "send", staticmethod(rec.send))
    monkeypatch.setattr(ring.P2P, "recv", staticmethod(rec.recv))
    return rec


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_ring_posts_each_pieces_next_receive_before_it_waits_for_this_one(recorder, world):
    pieces = 2
    flat = torch.zeros(20 * world, dtype=torch.float64)  # chunks of 20 elements: 160 bytes, 2 pieces of 80
    ring.ring_allreduce(flat, 0, world, piece_bytes=80)
    hops, left = 2 * (world - 1), world - 1
    for hop in range(hops - 1):
        for j in range(pieces):
            assert recorder.posted_before_wait(("recv", left, (hop + 1) * pieces + j), ("recv", left, hop * pieces + j))
    # Every message of a rank has a tag of its own: hop and piece.
    sends = [e for e in recorder.events if e[:2] == ("post", "send")]
    assert sorted(e[3] for e in sends) == list(range(hops * pieces))
    # and every message is waited for once, the sends that had gone as the next ones left
    assert recorder.every_post_waited()


def test_a_tree_root_posts_its_second_childs_receive_before_the_first_child_arrives(recorder):
    flat = torch.zeros(8, dtype=torch.float64)  # one piece: the plan runs on this thread
    steps.execute([tree.plan(8, 0, 4)], flat)
    assert recorder.posted_before_wait(("recv", 2, 0), ("recv", 1, 0))
    assert recorder.every_post_waited()
