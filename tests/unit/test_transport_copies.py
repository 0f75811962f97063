"""What a server's send keeps of the sender's memory (ps/transport.py): with pyzmq's sends, it
copies up to REPLY_COPY_BYTES, so nothing it sent points at the memory once send returns; with
its compiled sends (ps/_send.c) it copies up to SEND_COPY_BYTES and lends larger parts until
ZeroMQ has sent them, letting them go at its next receive or send, so a shard's next update of
a key finds it free (ps.shard.snapshots.in_use) unless the reply is still queued."""

from __future__ import annotations

import gc
import sys
import time

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


def _exported(buffer: bytearray) -> bool:
    """Whether something still holds a view of buffer (a bytearray with one cannot grow)."""
    try:
        buffer.append(0)
    except BufferError:
        return True
    buffer.pop()
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pair", ["compiled"], indirect=True)
def test_a_closed_server_sends_nothing_and_its_lent_parts_are_let_go_once_zeromq_drops_them(pair):
    """A send after close fails as pyzmq's did (libzmq has freed the socket: nothing reaches
    it); parts still queued when the sender went are let go by a later sweep of another
    once ZeroMQ has dropped them (after the socket's linger)."""
    server, client, peer = pair
    queued = [bytearray(2 << 20) for _ in range(16)]  # more than the kernel's buffers take: ZeroMQ holds some
    for part in queued:
        assert server.send(peer, [b"values", part])
    assert any(map(_exported, queued))
    server.close()
    assert not server.send(peer, [b"late", bytearray(1 << 20)])
    server._sender = None  # the sender goes; what ZeroMQ holds becomes an orphan
    client.close()
    other = ServerTransport("tcp://127.0.0.1:0", None, 10.0)
    try:
        for _ in range(100):
            other._sender.sweep()
            if not any(map(_exported, queued)):
                break
            time.sleep(0.05)
        assert not any(map(_exported, queued))
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_over_inproc_a_server_lends_only_what_pyzmq_lends():
    """inproc hands the parts themselves to the peer: the compiled sender copies there up to
    REPLY_COPY_BYTES, so that a client's frames are not the shard's own memory."""
    import zmq as _zmq

    context = _zmq.Context()
    server = ServerTransport("inproc://copies-test", None, 10.0, context=context)
    client = ClientTransport("inproc://copies-test", None, 10.0, context=context)
    try:
        client.send([b"hello"])
        peer, _ = server.recv(10.0)
        values = np.arange(256 << 10, dtype=np.uint8)
        alone = sys.getrefcount(values)
        assert server.send(peer, [b"values", memoryview(values).cast("B")])
        assert sys.getrefcount(values) == alone
        assert np.array_equal(np.frombuffer(client.recv(10.0, "the values")[1], dtype=np.uint8), values)
    finally:
        client.close()
        server.close()
        context.term()
