"""What a server's send keeps of the sender's memory (ps/transport.py): with pyzmq's sends, it
copies up to REPLY_COPY_BYTES, so nothing it sent points at the memory once send returns; with
its compiled sends (ps/_send.c) it copies up to SEND_COPY_BYTES and lends larger parts until
ZeroMQ has sent them, letting them go at its next receive or send, so a shard's next update of
a key finds it free (ps.shard.snapshots.in_use) unless the reply is still queued."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import zmq

from ps.transport import REPLY_COPY_BYTES, SEND_COPY_BYTES, ClientTransport, ServerTransport


@pytest.fixture
def pair(request):
    server = ServerTransport("tcp://127.0.0.1:0", None, 10.0)
    if request.param == "pyzmq":
        server._sender = None
    elif server._sender is None:
        server.close()
        pytest.skip("ps._send is not built")
    client = ClientTransport(server.address, None, 10.0)
    try:
        client.send([b"hello"])
        peer, _ = server.recv(10.0)
        yield server, client, peer
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pair", ["pyzmq", "compiled"], indirect=True)
def test_a_server_lets_go_of_what_it_sent_once_zeromq_has_sent_it(pair):
    server, client, peer = pair
    copied_up_to = REPLY_COPY_BYTES if server._sender is None else SEND_COPY_BYTES
    for nbytes in (1 << 10, 64 << 10, (64 << 10) + 1, 1 << 20, 2 << 20):
        values = np.arange(nbytes, dtype=np.uint8)
        alone = sys.getrefcount(values)
        assert server.send(peer, [b"values", memoryview(values).cast("B")])
        if nbytes <= copied_up_to:  # copied: the frame holds nothing of ours
            assert sys.getrefcount(values) == alone, nbytes
        got = client.recv(10.0, "the values")
        assert np.array_equal(np.frombuffer(got[1], dtype=np.uint8), values)
        if server._sender is not None:
            client.send([b"next"])
            server.recv(10.0)  # sent and received: the receive lets the lent part go
            assert sys.getrefcount(values) == alone and server._sender.sweep() == 0, nbytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pair", ["compiled"], indirect=True)
def test_a_lent_part_keeps_its_bytes_after_the_caller_lets_go(pair):
    server, client, peer = pair
    values = np.arange(1 << 21, dtype=np.uint8)
    expected = values.copy()
    assert server.send(peer, [b"values", memoryview(values).cast("B"), b"tail"])
    del values
    gc.collect()
    got = client.recv(10.0, "the values")
    assert np.array_equal(np.frombuffer(got[1], dtype=np.uint8), expected) and bytes(got[2]) == b"tail"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pair", ["compiled"], indirect=True)
def test_a_compiled_send_that_fails_holds_nothing(pair):
    """A part lent to a message that could not leave is let go; a part without a buffer is
    refused before anything leaves."""
    server, client, peer = pair
    values = np.arange(1 << 20, dtype=np.uint8)
    alone = sys.getrefcount(values)
    assert server._sender.send([b"nobody", b"values", memoryview(values).cast("B")]) == zmq.EHOSTUNREACH
    assert server._sender.sweep() == 0 and sys.getrefcount(values) == alone
    with pytest.raises(TypeError):
        server._sender.send([peer, memoryview(values).cast("B"), object()])
    assert server._sender.sweep() == 0 and sys.getrefcount(values) == alone
    assert server.send(peer, [b"still"]) and bytes(client.recv(10.0, "the next")[0]) == b"still"
