"""How many cores a shard takes (ps/cores.py), and the context's I/O threads it asks for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ps.cores import IO_THREADS_MAX, LOCAL_PROCESSES, core_share, host_cores, io_threads, local_processes


def test_processes_on_one_host_split_its_cores_evenly_and_never_take_none():
    cores = host_cores()
    assert core_share(1) == cores
    assert core_share(cores + 1) == 1
    assert core_share(2) == max(1, cores // 2)
    assert core_share(8, asked=3) == 3  # threads=N is what the user asked for, whatever the host


def test_the_launchers_count_is_read_and_a_bad_one_named():
    assert local_processes({}) == 1  # psar server on a host of its own
    assert local_processes({LOCAL_PROCESSES: "9"}) == 9
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=LOCAL_PROCESSES):
            local_processes({LOCAL_PROCESSES: bad})
    with pytest.raises(ValueError, match="threads=-1"):
        core_share(2, asked=-1)


def test_io_threads_follow_the_connections_up_to_the_share_and_the_cap():
    assert io_threads(1, 8) == 1
    assert io_threads(16, 1) == 1  # one worker's connection runs on one I/O thread
    assert io_threads(16, 2) == 2
    assert io_threads(16, 64) == IO_THREADS_MAX
    assert io_threads(3, 64) == 3


@pytest.mark.timeout(60)
def test_a_context_takes_its_io_threads_before_its_first_socket_and_keeps_them_after():
    code = textwrap.dedent("""
        import zmq
        from ps.transport import ClientTransport, ServerTransport, default_context, use_io_threads
        assert use_io_threads(3) == 3
        server = ServerTransport("tcp://127.0.0.1:0", None, 10.0)
        client = ClientTransport(server.address, None, 10.0)
        client.send([b"x", b"y" * 100000])
        peer, frames = server.recv(10.0)
        server.send(peer, frames)
        assert bytes(client.recv(10.0, "echo")[1]) == b"y" * 100000
        print(default_context().get(zmq.IO_THREADS), use_io_threads(5))  # started: it stays at 3
        client.close(); server.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]
    with pytest.raises(ValueError, match="at least 1 I/O thread"):
        from ps.transport import use_io_threads
        use_io_threads(0)
