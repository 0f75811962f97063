"""A server copies what it sends up to REPLY_COPY_BYTES: nothing it sent still points at the
sender's memory once send returns, so a shard's next update of a key never has to move it
away from a reply (ps/transport.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ps.transport import ClientTransport, ServerTransport


@pytest.mark.timeout(60)
def test_a_server_lets_go_of_what_it_sent_up_to_a_mebibyte_at_once():
    server = ServerTransport("tcp://127.0.0.1:0", None, 10.0)
    client = ClientTransport(server.address, None, 10.0)
    try:
        client.send([b"hello"])
        peer, _ = server.recv(10.0)
        for nbytes in (64 << 10, 1 << 20, 2 << 20):
            values = np.arange(nbytes, dtype=np.uint8)
            alone = sys.getrefcount(values)
            assert server.send(peer, [b"values", memoryview(values).cast("B")])
            if nbytes <= 1 << 20:  # copied: the frame holds nothing of ours
                assert sys.getrefcount(values) == alone, nbytes
            got = client.recv(10.0, "the values")
            assert np.array_equal(np.frombuffer(got[1], dtype=np.uint8), values)
    finally:
        client.close()
        server.close()
