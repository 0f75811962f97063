"""How many calls a push+pull of one key makes, at both ends: what its time is on a core that
slept in a poll between messages (docs/results.md, "The push+pull path"). Counted, not timed,
so the count is the same on every machine; a change that sends the message the long way again
(ps.protocol.decode, the shard's general dispatch) or adds work per message fails here, and
`psar bench` says what it costs."""

import gc
import sys
from collections import Counter

import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.local import LocalCluster
from ps.protocol import encode
from ps import client_compiled
from ps.shard import ShardServer, compiled

LAYOUT = build_layout([ParamSpec("w", (256,), "float32"), ParamSpec("b", (256,), "float32")], 1, 1 << 20)
BUDGET = {"shard": 100, "compiled": 5, "push": 45, "wait": 80, "lane push": 8, "lane wait": 45,
          "window push": 12, "window wait": 45}
"""Calls (Python functions and C functions called from Python) at most, of one 1 KiB
push+pull: the short paths make 90, 35 and 65 of them, the general ones 164, 72 and 90, a
shard's compiled path (ps.shard.compiled) 3, the clock's among them; a worker's compiled
lane (ps.client_compiled) 4 and 39, and 11 and 39 under a window (ps-sync's workers)."""


def counted(fn, *args):
    """fn(*args) and the calls it made, by name."""
    calls = Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls["C:" + getattr(arg, "__qualname__", str(arg))] += 1

    collecting = gc.isenabled()
    gc.disable()  # the collector's finalizers (other tests' garbage) are not calls of fn's
    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return result, calls


@pytest.mark.parametrize("path", ["python", "compiled"])
def test_a_shard_takes_a_push_pull_in_its_budget_of_calls(path):
    if path == "compiled" and not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, [torch.zeros(256), torch.zeros(256)], 0),
                         lambda p: torch.optim.SGD(p, lr=0.1), "async", 1, PSConfig())
    if path == "python":
        server._short.compiled = None
    server.handle(b"w0", encode({"op": "join", "worker": 0, "req": 0}))
    for step in range(3):  # the third is counted
        frames = encode({"op": "push", "worker": 0, "req": step + 1, "step": step, "version": server.version,
                         "keys": [0], "pull": 1, "clock": step + 1}, [torch.ones(256)])
        frames = [bytes(frames[0]), memoryview(bytearray(frames[1]))]  # as the transport hands them over
        replies, calls = counted(server.handle, b"w0", frames)
        del replies  # sent: the reply no longer holds the key's memory
    assert calls["fastpath.py:__call__"] == 1 and calls["protocol.py:decode"] == 0
    assert sum(calls.values()) <= BUDGET["shard" if path == "python" else "compiled"], calls.most_common(20)


SYNC_BUDGET = (95, 220)
"""Calls at most of a sync step's push+pulls of two 1 KiB keys by two workers: the first,
which waits (86 of them), and the last, which updates and answers both (206; 234 when the
pull that waited was written by encode and each sum reshaped to its own shape)."""


def test_a_sync_step_is_taken_in_its_budget_of_calls():
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, [torch.zeros(256), torch.zeros(256)], 0),
                         lambda p: torch.optim.SGD(p, lr=0.1), "sync", 2, PSConfig())
    for w in range(2):
        server.handle(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    for step in range(3):  # the third is counted
        made = []
        for w in range(2):
            frames = encode({"op": "push", "worker": w, "req": step + 1, "step": step, "version": server.version,
                             "keys": [0, 1], "pull": 1, "min_version": step + 1}, [torch.ones(256), torch.ones(256)])
            frames = [bytes(frames[0]), *(memoryview(bytearray(f)) for f in frames[1:])]
            replies, calls = counted(server.handle, f"w{w}".encode(), frames)
            made.append((len(replies), calls))
            del replies  # sent
    assert server.version == 3 and [n for n, _ in made] == [0, 2]
    for budget, (_, calls) in zip(SYNC_BUDGET, made):
        assert calls["protocol.py:decode"] == 0 and sum(calls.values()) <= budget, calls.most_common(20)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["python", "compiled", "window"])
def test_a_worker_sends_and_files_a_push_pull_in_its_budget_of_calls(path):
    if path != "python" and not client_compiled.available():
        pytest.skip("ps._client is not built")
    config = PSConfig(timeout_s=10.0, heartbeat_s=5.0, worker_timeout_s=10.0)
    with LocalCluster(LAYOUT, [torch.zeros(256), torch.zeros(256)], lambda p: torch.optim.SGD(p, lr=0.1),
                      "async", 1, config) as cluster, \
            cluster.client(0, window_mb=1.0 if path == "window" else 0.0) as client:
        client.join()
        if path == "python":
            client._lane = None
        g = torch.ones(256)
        for step in range(3):  # the third is counted
            handle, push_calls = counted(client.push, step, None, {0: g}, True)
            assert client._transports[0].readable(10)  # the reply is in: the wait files it at once
            result, wait_calls = counted(client.wait, handle)
            assert torch.equal(result.values[0], torch.full((256,), -0.1 * (step + 1)))
    if path == "python":
        assert push_calls["protocol.py:encode_whole"] == 1 and push_calls["protocol.py:encode"] == 0
        assert wait_calls["protocol_short.py:decode_reply"] == 1 and wait_calls["protocol.py:decode"] == 0
    else:
        assert push_calls["C:Lane.push"] == 1 and wait_calls["C:Lane.take"] == 1
        assert wait_calls["protocol_short.py:decode_reply"] == 0 and wait_calls["protocol.py:decode"] == 0
    push_budget, wait_budget = {"python": ("push", "wait"), "compiled": ("lane push", "lane wait"),
                                "window": ("window push", "window wait")}[path]
    assert sum(push_calls.values()) <= BUDGET[push_budget], push_calls.most_common(20)
    assert sum(wait_calls.values()) <= BUDGET[wait_budget], wait_calls.most_common(20)
