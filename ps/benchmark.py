"""Push+pull bandwidth of one worker against one server shard, next to a plain ZeroMQ round
trip of the same bytes through the same transport (`psar bench` drives it).

The server side runs in its own process: `python -m ps.benchmark serve ECHO_ADDR PS_ADDR`
hosts an echo socket (the yardstick: bytes in, the same bytes out) and an async shard whose
parameters are one tensor per message size, updated by SGD on every push.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from .client import PSClient
from .config import PSConfig
from .layout import ParamSpec, build_layout, split_values
from .server import ShardServer
from .transport import ClientTransport, ServerTransport

SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
CONFIG = PSConfig(async_scale="sum", chunk_mb=1024.0, timeout_s=120.0, worker_timeout_s=600.0)


def _layout():
    specs = [ParamSpec(f"p{n}", (n // 4,), "float32") for n in SIZES]
    return build_layout(specs, 1, 2**30)


def serve(echo_addr: str, ps_addr: str) -> None:
    layout = _layout()
    params = [torch.zeros(s.shape) for s in layout.specs]
    shard = ShardServer(0, layout, split_values(layout, params, 0),
                        lambda ps: torch.optim.SGD(ps, lr=1e-6), "async", 1, CONFIG)
    echo = ServerTransport(echo_addr, CONFIG.max_message_bytes, CONFIG.timeout_s)
    ps_transport = ServerTransport(ps_addr, CONFIG.max_message_bytes, CONFIG.timeout_s)
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
    shard.serve(ps_transport, stop)
    thread.join(5)


def _echo_round_trip(client: ClientTransport, payload: torch.Tensor) -> None:
    client.send([b"x", memoryview(payload.numpy()).cast("B")])
    client.recv(CONFIG.timeout_s, "echo")


def measure(echo_addr: str, ps_addr: str, rounds: int = 5) -> list[dict]:
    """Median seconds per round trip for each size: plain ZeroMQ and PS push+pull, interleaved."""
    echo = ClientTransport(echo_addr, CONFIG.max_message_bytes, CONFIG.timeout_s)
    ps = PSClient([ps_addr], 0, timeout_s=CONFIG.timeout_s, heartbeat_s=CONFIG.heartbeat_s)
    layout, _, _ = ps.join()
    rows = []
    step = 0  # every push is a new step: the server refuses a key pushed twice for one step
    try:
        for index, nbytes in enumerate(SIZES):
            key = layout.param_keys(index)[0].id
            payload = torch.ones(nbytes // 4)
            iters = max(2, min(200, (64 * 2**20) // nbytes // 8))
            zmq_t, ps_t = [], []
            for r in range(rounds + 1):
                start = time.perf_counter()
                for _ in range(iters):
                    _echo_round_trip(echo, payload)
                mid = time.perf_counter()
                for _ in range(iters):  # one message each way, as the sync engine sends its buckets
                    ps.wait(ps.push(step, None, {key: payload}, pull=True))
                    step += 1
                end = time.perf_counter()
                if r:  # the first round warms up
                    zmq_t.append((mid - start) / iters)
                    ps_t.append((end - mid) / iters)
            z, p = statistics.median(zmq_t), statistics.median(ps_t)
            rows.append({"bytes": nbytes, "zmq_us": z * 1e6, "ps_us": p * 1e6,
                         "zmq_gbs": 2 * nbytes / z / 1e9, "ps_gbs": 2 * nbytes / p / 1e9,
                         "ratio": z / p})
        echo.send([b"stop"])
        echo.recv(CONFIG.timeout_s, "echo stop")
    finally:
        ps.close()
        echo.close()
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit("usage: python -m ps.benchmark serve ECHO_ADDR PS_ADDR")
    torch.set_num_threads(1)
    serve(sys.argv[2], sys.argv[3])
