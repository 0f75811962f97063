"""CurveZMQ on the parameter server (tcp on 127.0.0.1): keys, who gets in, what the wire
carries; and a round trip that fails if anything is pickled. About 5 s of tests on 2 cores
(plus the imports; the first cluster of a process pays about 2 s of torch warm-up)."""

import logging
import pickle
import re
import selectors
import shutil
import socket
import stat
import struct
import threading

import _pickle
import time

import pytest
import torch

from ps.client import PSClient, PeerTimeout
from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, join_values, split_values
from ps.local import LocalCluster
from ps.security import load_client_keys, load_server_keys, make_keys

SPECS = [ParamSpec("w", (8, 6), "float64"), ParamSpec("b", (6,), "float64")]
LAYOUT = build_layout(SPECS, 2, 20)
FAST = dict(timeout_s=5.0, heartbeat_s=0.05, worker_timeout_s=2.0)
REFUSED_WAIT_S = 0.6


def init_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s.shape, dtype=torch.float64, generator=gen) for s in SPECS]


def grads(value):
    return split_values(LAYOUT, [torch.full(s.shape, value, dtype=torch.float64) for s in SPECS])


@pytest.fixture
def keys(tmp_path):
    """A key directory with clients "worker" (allowed) and "intruder" (a keypair, not allowed)."""
    directory = tmp_path / "keys"
    make_keys(directory, ("worker", "intruder"))
    (directory / "allowed" / "intruder.key").unlink()
    return directory


def cluster(curve_dir="", workers=1):
    return LocalCluster(LAYOUT, init_params(), lambda p: torch.optim.SGD(p, lr=1.0), "sync", workers,
                        PSConfig(curve_dir=str(curve_dir), **FAST), address="tcp")


def any_address(cl):
    """The refused send or wait may be the one to either shard: the error names that shard."""
    return "|".join(re.escape(a) for a in cl.addresses)


def assert_unchanged(cl):
    """Nothing reached a handler, and an allowed worker finds the initial parameters."""
    for server in cl.servers:
        assert server.counters["joins"] == server.counters["malformed"] == server.counters["rejected"] == 0
        assert server.counters["bytes_in"] == 0
    with cl.client(0) as c:
        _, version, values = c.join()
        assert version == 0
        for got, want in zip(join_values(LAYOUT, values), init_params()):
            assert torch.equal(got, want)


# -- keys --------------------------------------------------------------------------------------

def test_make_keys_writes_zmq_certificates(tmp_path):
    directory = tmp_path / "k"
    paths = make_keys(directory, ("w0", "w1"))
    assert set(paths) == {"server", "server_public", "allowed", "w0", "w1"}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in ("server", "w0", "w1"):
        assert paths[name] == directory / f"{name}.key_secret"
        assert stat.S_IMODE(paths[name].stat().st_mode) == 0o600
        assert "secret-key" in paths[name].read_text()  # zmq's text certificate format
        assert "secret-key" not in (directory / f"{name}.key").read_text()
    assert sorted(p.name for p in paths["allowed"].iterdir()) == ["w0.key", "w1.key"]
    assert not list(directory.glob(".keys-*")), "scratch folders are removed"

    server, w0 = load_server_keys(directory), load_client_keys(directory, "w0")
    assert w0.server_public == server.public and len(server.public) == len(w0.secret) == 40
    assert server.allowed_dir == str(paths["allowed"].resolve())
    assert server.secret.decode() not in repr(server) and w0.secret.decode() not in repr(w0)

    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    make_keys(directory, ("w1", "w2"))  # keeps what is there, adds w2
    assert all((directory / name).read_bytes() == data for name, data in before.items())
    assert (directory / "allowed" / "w2.key").is_file() and load_client_keys(directory, "w2").public != w0.public


def test_key_errors_name_the_problem(tmp_path):
    for bad in ("", "server", "allowed", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="client key name"):
            make_keys(tmp_path / "k", (bad,))
    with pytest.raises(FileNotFoundError, match=r"server\.key_secret"):
        load_server_keys(tmp_path / "missing")
    make_keys(tmp_path / "k")
    with pytest.raises(FileNotFoundError, match=r"nobody\.key_secret"):
        load_client_keys(tmp_path / "k", "nobody")
    with pytest.raises(ValueError, match="curve_dir must be a str"):
        PSConfig(curve_dir=None)


# -- who gets in -------------------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_allowed_client_joins_pushes_and_pulls(keys):
    with cluster(keys) as cl:
        with cl.client(0) as c:
            _, version, _ = c.join()
            c.wait(c.push(0, version, grads(0.5)))
            result = c.wait(c.pull(min_version=1))
            assert result.versions == {0: 1, 1: 1}
            for got, start in zip(join_values(LAYOUT, result.values), init_params()):
                assert torch.equal(got, start - 0.5)
            assert [s["updates"] for s in c.stats()] == [1, 1]
            # Both connections (requests, heartbeats) complete their handshakes; the heartbeat
            # thread's may finish after a fast exchange, so wait for it while the client lives.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not all(t.events["handshakes"] >= 2 for t in cl.transports):
                time.sleep(0.01)
        assert all(t.events["handshakes"] >= 2 and t.events["refused"] == 0 for t in cl.transports)


@pytest.mark.timeout(20)
def test_client_with_a_key_not_allowed_is_refused(keys, caplog):
    with cluster(keys) as cl:
        with caplog.at_level(logging.WARNING, logger="psar.ps.transport"):
            with cl.client(0, curve_name="intruder", timeout_s=REFUSED_WAIT_S) as bad:
                with pytest.raises(PeerTimeout, match=any_address(cl)) as info:
                    bad.join()
        assert "refused this client's CURVE key" in str(info.value)
        assert all(t.events["refused"] >= 1 for t in cl.transports)
        assert f"{cl.addresses[0]}: refused a client at the handshake" in caplog.text
        assert "not among the allowed client keys" in caplog.text
        assert_unchanged(cl)


@pytest.mark.timeout(20)
def test_client_without_curve_is_refused(keys, caplog):
    with cluster(keys) as cl:
        with caplog.at_level(logging.WARNING, logger="psar.ps.transport"):
            with cl.client(0, curve_dir="", timeout_s=REFUSED_WAIT_S) as plain:
                with pytest.raises(PeerTimeout, match=any_address(cl)) as info:
                    plain.join()
        assert "mechanism mismatch" in str(info.value) and "mechanism mismatch" in caplog.text
        assert_unchanged(cl)


@pytest.mark.timeout(20)
def test_client_pinned_to_another_server_key_does_not_talk_to_this_one(keys, tmp_path):
    """Server authentication: a worker holding another server's public key (say, that of the
    server it meant to reach) never completes a handshake with this one."""
    other = tmp_path / "other"
    make_keys(other)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(keys / "worker.key_secret", mixed)
    shutil.copy(other / "server.key", mixed)
    with cluster(keys) as cl:
        with cl.client(0, curve_dir=str(mixed), timeout_s=REFUSED_WAIT_S) as c:
            with pytest.raises(PeerTimeout, match=any_address(cl)):
                c.join()
        assert all(t.events["refused"] >= 1 for t in cl.transports)
        assert_unchanged(cl)


@pytest.mark.timeout(20)
def test_curve_client_does_not_talk_to_a_plain_server(keys):
    with cluster("") as cl:
        with cl.client(0, curve_dir=str(keys), timeout_s=REFUSED_WAIT_S) as c:
            with pytest.raises(PeerTimeout, match="mechanism mismatch"):
                c.join()
        assert_unchanged(cl)


# -- what the wire carries ---------------------------------------------------------------------

class Tap:
    """A TCP relay on 127.0.0.1 to `port` that keeps every byte passing through, both ways."""

    def __init__(self, port):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self):
        sel, peer = selectors.DefaultSelector(), {}
        sel.register(self.listener, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                s = key.fileobj
                if s is self.listener:
                    a, _ = s.accept()
                    b = socket.create_connection(self.target, timeout=5)
                    peer[a], peer[b] = b, a
                    sel.register(a, selectors.EVENT_READ)
                    sel.register(b, selectors.EVENT_READ)
                    continue
                try:
                    data = s.recv(1 << 16)
                except OSError:
                    data = b""
                if s not in peer:
                    continue
                if data:
                    self.seen += data
                    peer[s].sendall(data)
                else:
                    for x in (s, peer.pop(s)):
                        peer.pop(x, None)
                        sel.unregister(x)
                        x.close()
        for s in [self.listener, *peer]:
            s.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("curve", [False, True])
def test_curve_encrypts_the_traffic(keys, curve):
    layout = build_layout([ParamSpec("m", (64,), "float64")], 1, 64)
    marker = 1234.5678
    with LocalCluster(layout, [torch.zeros(64, dtype=torch.float64)], lambda p: torch.optim.SGD(p, lr=1.0),
                      "sync", 1, PSConfig(curve_dir=str(keys) if curve else "", **FAST), address="tcp") as cl:
        tap = Tap(int(cl.addresses[0].rsplit(":", 1)[1]))
        try:
            with PSClient([tap.address], 0, timeout_s=5.0, heartbeat_s=0.05,
                          curve_dir=str(keys) if curve else "") as c:
                c.join()
                c.wait(c.push(0, 0, {0: torch.full((64,), marker, dtype=torch.float64)}))
                result = c.wait(c.pull(min_version=1))
                assert torch.equal(result.values[0], torch.full((64,), -marker, dtype=torch.float64))
        finally:
            tap.close()
    plain = [struct.pack("<d", marker) * 8, struct.pack("<d", -marker) * 8, b"push", b"layout"]
    assert len(tap.seen) > 64 * 8 * 2
    found = [p for p in plain if p in tap.seen]
    assert found == ([] if curve else plain)


# -- no pickle ---------------------------------------------------------------------------------

@pytest.mark.timeout(20)
@pytest.mark.parametrize("curve", [False, True])
def test_nothing_on_the_wire_is_pickled(keys, monkeypatch, curve):
    """A whole tcp round trip (join, push, pull, stats, checkpoint, leave) with every pickle
    entry point raising, and recording the call in case something swallows the error."""
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"pickle.{name} was called")
        return call

    def refusing_class(base, name):
        def __init__(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"pickle.{name} was instantiated")
        return type(f"Refusing{name}", (base,), {"__init__": __init__})

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load"):
            monkeypatch.setattr(module, name, refuse(name))
        for name in ("Pickler", "Unpickler"):
            monkeypatch.setattr(module, name, refusing_class(getattr(module, name), name))
    with pytest.raises(AssertionError, match="pickle.dumps"):
        pickle.dumps(1)  # the patch holds
    calls.clear()

    with cluster(keys if curve else "") as cl:
        with cl.client(0) as c:
            _, version, values = c.join()
            c.wait(c.push(0, version, grads(0.25)))
            result = c.wait(c.pull(min_version=1))
            stats = c.stats()
            versions, snapshot = c.checkpoint()
            c.leave()
        assert cl.join(5.0) and set(cl.results.values()) == {"finished"}
    assert calls == []
    assert [s["pushes"] for s in stats] == [1, 1] and versions == {0: 1, 1: 1}
    for got, start in zip(join_values(LAYOUT, snapshot), join_values(LAYOUT, values)):
        assert torch.equal(got, start - 0.25)
    assert all(torch.equal(result.values[k], snapshot[k]) for k in snapshot)


def test_a_plain_client_is_not_told_about_server_keys():
    import zmq

    from ps.transport import _handshake_text

    plain = _handshake_text(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, server=False, curve=False)
    assert "this worker uses no CURVE" in plain and "server public key" not in plain
    curve = _handshake_text(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, server=False, curve=True)
    assert "wrong server public key" in curve and "without --curve" in curve
