"""Push+pull bandwidth of one worker against one server shard, next to a plain ZeroMQ round
trip of the same bytes through the same transport (`psar bench` drives it); and the bytes/s
that many workers move through one or several shards on one host, next to what they move
through as many echo sockets.

The server side runs in its own process: `python -m ps.benchmark serve ECHO_ADDR PS_ADDR
[WORKERS [THREADS [LEGS_JSON MIN_BYTES]]]` hosts an echo socket (the yardstick: bytes in, the same bytes out) and an async
shard whose parameters are one tensor per message size, updated by SGD on every push: on
THREADS cores (psar bench gives it its part of the host's; 0: its share, as a run's shard
takes, ps/cores.py; ShardServer.use_cores), the echo on the shard's I/O threads; with LEGS_JSON, it
writes there when each message of at least MIN_BYTES came out of its receive and went into
its send (TimedTransport; experiments/bench/legs.py). Each of many workers is a process too:
`python -m ps.benchmark load ...` (see load).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .allocator import keep_freed_pages
from .client import PSClient
from .cores import core_share, io_threads, local_processes
from .config import PSConfig
from .layout import ParamSpec, build_layout, split_values
from .shard import ShardServer
from .transport import ClientTransport, ServerTransport, use_io_threads

SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
CONFIG = PSConfig(async_scale="sum", chunk_mb=1024.0, timeout_s=120.0, worker_timeout_s=600.0)


def _layout():
    specs = [ParamSpec(f"p{n}", (n // 4,), "float32") for n in SIZES]
    return build_layout(specs, 1, 2**30)


class TimedTransport(ServerTransport):
    """A ServerTransport that notes when each message of at least min_bytes came out of recv
    ("r") and went into send ("s"), in ns of the host's monotonic clock, which every process
    of the host reads alike: experiments/bench/legs.py lines them up with a worker's. A send's
    mark also holds what count() says then (the shard's keys moved before an update), and the
    CPU time its thread has used so far (ns: from one send to the next, the thread's own work
    on a message, its wait for it in a poll and its receive included, its sleep not)."""

    def __init__(self, bind: str, max_message_bytes: int | None, send_timeout_s: float, min_bytes: int,
                 count=lambda: 0) -> None:
        super().__init__(bind, max_message_bytes, send_timeout_s)
        self.min_bytes, self.count = min_bytes, count
        self.marks: list[tuple] = []

    def recv(self, timeout_s: float):
        item = super().recv(timeout_s)
        if item is not None and sum(memoryview(f).nbytes for f in item[1]) >= self.min_bytes:
            self.marks.append(("r", time.monotonic_ns()))
        return item

    def send(self, peer: bytes, frames) -> bool:
        if sum(memoryview(f).nbytes for f in frames) >= self.min_bytes:
            self.marks.append(("s", time.monotonic_ns(), self.count(), time.thread_time_ns()))
        return super().send(peer, frames)


def serve(echo_addr: str, ps_addr: str, workers: int = 1, threads: int = 0, legs: str = "",
          min_bytes: int = 0) -> None:
    """threads: the shard's cores for its updates (0: its share of the host's, ps/cores.py).
    legs: a JSON file for each socket's marks ({"echo": [...], "ps": [...]}, TimedTransport's,
    of messages of at least min_bytes), written once stopped; "": none kept."""
    keep_freed_pages()
    threads = core_share(local_processes(), threads)
    torch.set_num_threads(threads)
    use_io_threads(io_threads(threads, workers))  # the echo's too: the yardstick has what the shard has
    layout = _layout()
    params = [torch.zeros(s.shape) for s in layout.specs]
    shard = ShardServer(0, layout, split_values(layout, params, 0),
                        lambda ps: torch.optim.SGD(ps, lr=1e-6), "async", workers, CONFIG)
    shard.use_cores(threads)  # as a run's shard: its own threads for SGD, torch on one
    def transport(addr: str, count=lambda: 0) -> ServerTransport:
        if legs:
            return TimedTransport(addr, CONFIG.max_message_bytes, CONFIG.timeout_s, min_bytes, count)
        return ServerTransport(addr, CONFIG.max_message_bytes, CONFIG.timeout_s)

    echo = transport(echo_addr)
    ps_transport = transport(ps_addr, lambda: shard.counters["moved_keys"])
    stop = threading.Event()

    def echo_loop():
        while not stop.is_set():
            item = echo.recv(0.1)
            if item is not None:
                peer, frames = item
                if bytes(frames[0]) == b"stop":
                    stop.set()
                echo.send(peer, frames)

    thread = threading.Thread(target=echo_loop, daemon=True)
    thread.start()
    shard.serve(ps_transport, stop)  # ends once every worker has left, or at the echo's stop
    # The stop comes after the last worker process has ended, which on a busy host may be
    # seconds after its leave: the echo answers it until then (the caller kills a server it
    # no longer waits for).
    thread.join(CONFIG.timeout_s)
    if legs:
        tmp = Path(f"{legs}.{os.getpid()}.tmp")  # whole or not at all: the worker reads it
        tmp.write_text(json.dumps({"echo": echo.marks, "ps": ps_transport.marks}))
        os.replace(tmp, legs)


WINDOW_BYTES = int(PSConfig.window_mb * (1 << 20))
"""The streamed columns keep this many bytes of messages in flight (ps.window_mb's default),
as the sync engine does with its pieces."""


def _echo_stream(client: ClientTransport, payload: torch.Tensor, iters: int, depth: int) -> None:
    """iters round trips of payload, depth of them in flight."""
    frames = [b"x", memoryview(payload.numpy()).cast("B")]
    inflight = 0
    for _ in range(iters):
        if inflight == depth:
            client.recv(CONFIG.timeout_s, "echo")
            inflight -= 1
        client.send(frames)
        inflight += 1
    for _ in range(inflight):
        client.recv(CONFIG.timeout_s, "echo")


def _ps_stream(ps: PSClient, key: int, payload: torch.Tensor, iters: int, depth: int, step: int) -> int:
    """iters push+pulls of payload to key, depth of them in flight; the next step number."""
    inflight = []
    for _ in range(iters):
        if len(inflight) == depth:
            ps.wait(inflight.pop(0))
        inflight.append(ps.push(step, None, {key: payload}, pull=True))
        step += 1
    for h in inflight:
        ps.wait(h)
    return step


def measure(echo_addr: str, ps_addr: str, rounds: int = 9) -> list[dict]:
    """Median seconds per message for each size, plain ZeroMQ round trips and PS push+pulls
    (one message each way, as the sync engine sends its pieces), interleaved: one at a time
    (latency), and streamed with WINDOW_BYTES in flight (throughput, at most 8 messages).
    ratio: the median over the rounds of each round's ZeroMQ time over its push+pull time."""
    rows = []
    step = 0  # every push is a new step: the server refuses a key pushed twice for one step
    with one_worker(echo_addr, ps_addr) as (echo, ps, layout):
        for index, nbytes in enumerate(SIZES):
            key = layout.param_keys(index)[0].id
            payload = torch.ones(nbytes // 4)
            iters = max(2, min(200, (64 * 2**20) // nbytes // 8))
            row = {"bytes": nbytes}
            for name, depth in (("", 1), ("stream_", max(1, min(8, WINDOW_BYTES // nbytes)))):
                zmq_t, ps_t = [], []
                for r in range(rounds + 1):
                    start = time.perf_counter()
                    _echo_stream(echo, payload, iters, depth)
                    mid = time.perf_counter()
                    step = _ps_stream(ps, key, payload, iters, depth, step)
                    end = time.perf_counter()
                    if r:  # the first round warms up
                        zmq_t.append((mid - start) / iters)
                        ps_t.append((end - mid) / iters)
                z, p = statistics.median(zmq_t), statistics.median(ps_t)
                paired = statistics.median(a / b for a, b in zip(zmq_t, ps_t))  # each round's pair a moment apart
                row.update({f"{name}zmq_us": z * 1e6, f"{name}ps_us": p * 1e6, f"{name}zmq_gbs": 2 * nbytes / z / 1e9,
                            f"{name}ps_gbs": 2 * nbytes / p / 1e9, f"{name}ratio": paired, f"{name}depth": depth})
            rows.append(row)
    return rows


@contextmanager
def one_worker(echo_addr: str, ps_addr: str):
    """(echo client, joined PSClient, its layout) of the one-at-a-time server (serve); the
    server is told to stop once the block has run through, and both clients closed."""
    keep_freed_pages()
    echo = ClientTransport(echo_addr, CONFIG.max_message_bytes, CONFIG.timeout_s)
    ps = PSClient([ps_addr], 0, timeout_s=CONFIG.timeout_s, heartbeat_s=CONFIG.heartbeat_s)
    try:
        layout, _, _ = ps.join()
        yield echo, ps, layout
        echo.send([b"stop"])
        echo.recv(CONFIG.timeout_s, "the echo's stop")
    finally:
        ps.close()
        echo.close()


LOAD_SIZES = (64 << 10, 1 << 20)
"""Message sizes of the many-worker rows."""
LOAD_PHASE_S = 1.5
"""Each size's ZeroMQ phase and push+pull phase each last this long (all workers at once)."""
LOAD_GAP_S = 0.25
"""Between two phases: the slowest worker's last message of one is done before the next begins."""


def load(echo_addr: str, ps_addr: str, worker: int, go_path: str, out_path: str) -> None:
    """One of many workers, as worker `worker` of its shard: once joined, writes OUT_PATH.ready
    and waits for go_path to name the start (time.time(), the same for every worker); then
    for each of LOAD_SIZES, ZeroMQ round trips during one phase and push+pulls during the
    next, at the same wall-clock times as every other worker; writes how many each phase
    completed ({"zmq": {size: n}, "ps": {size: n}}, JSON) to out_path."""
    keep_freed_pages()
    echo = ClientTransport(echo_addr, CONFIG.max_message_bytes, CONFIG.timeout_s)
    ps = PSClient([ps_addr], worker, timeout_s=CONFIG.timeout_s, heartbeat_s=CONFIG.heartbeat_s)
    layout, _, _ = ps.join()
    Path(out_path + ".ready").touch()
    deadline = time.monotonic() + CONFIG.timeout_s
    while not Path(go_path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker}: no start in {go_path} within {CONFIG.timeout_s:g} s")
        time.sleep(0.01)
    start_at = float(Path(go_path).read_text())
    done: dict[str, dict[int, int]] = {"zmq": {}, "ps": {}}
    step = 0
    try:
        for i, nbytes in enumerate(LOAD_SIZES):
            key = layout.param_keys(SIZES.index(nbytes))[0].id
            payload = torch.ones(nbytes // 4)
            frames = [b"x", memoryview(payload.numpy()).cast("B")]
            begin = start_at + i * 2 * (LOAD_PHASE_S + LOAD_GAP_S)
            for name, phase_at in (("zmq", begin), ("ps", begin + LOAD_PHASE_S + LOAD_GAP_S)):
                late = time.time() - phase_at
                if late > LOAD_GAP_S:  # its phase would be short, and the others' crowded less
                    raise RuntimeError(f"worker {worker}: reached the {name} phase at {nbytes} bytes {late:.2f} s "
                                       f"after it began (a start in {go_path} that was already past?)")
                time.sleep(max(0.0, -late))
                n, end = 0, phase_at + LOAD_PHASE_S
                while time.time() < end:
                    if name == "zmq":
                        echo.send(frames)
                        echo.recv(CONFIG.timeout_s, "echo")
                    else:
                        ps.wait(ps.push(step, None, {key: payload}, pull=True))
                        step += 1
                    n += 1
                done[name][nbytes] = n
        ps.leave()
    finally:
        ps.close()
        echo.close()
    tmp = Path(f"{out_path}.{os.getpid()}.tmp")  # whole or not at all: the parent reads it
    tmp.write_text(json.dumps(done))
    os.replace(tmp, out_path)


def aggregate(counts: list[dict], phase_s: float = LOAD_PHASE_S) -> list[dict]:
    """Rows of the many-worker table from each worker's counts (load's JSON): per size, the
    bytes/s all workers moved (each round trip or push+pull moves its bytes each way) through
    ZeroMQ and through the shards, and ps/zmq."""
    rows = []
    for nbytes in LOAD_SIZES:
        moved = {name: sum(c[name][str(nbytes)] for c in counts) * 2 * nbytes / phase_s for name in ("zmq", "ps")}
        rows.append({"bytes": nbytes, "zmq_gbs": moved["zmq"] / 1e9, "ps_gbs": moved["ps"] / 1e9,
                     "ratio": moved["ps"] / moved["zmq"] if moved["zmq"] else float("nan")})
    return rows


if __name__ == "__main__":
    usage = ("usage: python -m ps.benchmark serve ECHO_ADDR PS_ADDR [WORKERS [THREADS [LEGS_JSON MIN_BYTES]]] | "
             "load ECHO_ADDR PS_ADDR WORKER GO_FILE OUT_JSON")
    torch.set_num_threads(1)  # a load; serve takes its share (ps/cores.py), as a run's shards do
    if len(sys.argv) in (4, 5, 6) and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
    elif len(sys.argv) == 8 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7]))
    elif len(sys.argv) == 7 and sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        sys.exit(usage)
