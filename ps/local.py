"""Server shards served by threads of this process: for tests, demos and one-host runs."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ps.client import PSClient
from ps.config import PSConfig
from ps.layout import Layout, split_values
from ps.security import load_server_keys
from ps.shard import ShardServer
from ps.transport import ServerTransport, TransportError

log = logging.getLogger("psar.ps.local")
_names = itertools.count()


class LocalCluster:
    """One ShardServer per shard of layout, each serving in its own thread.

    Args:
        layout: the layout; one shard per layout.num_shards.
        params: initial parameter tensors in layout.specs order (copied by the servers).
        make_optimizer, mode, num_workers, config: as for ShardServer.
        address: "inproc" (unique inproc:// names) or "tcp" (127.0.0.1, ephemeral ports).
        addresses: explicit bind endpoints, one per shard (overrides address).
        context: zmq context to share with inproc clients (default: the process-wide one).

    With config.curve_dir set, the shards require CurveZMQ with that key directory's server
    keys and allowed clients, and client() connects with its "worker" keys by default.
    """

    def __init__(self, layout: Layout, params: Sequence[torch.Tensor],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], mode: str,
                 num_workers: int, config: PSConfig = PSConfig(), address: str = "inproc",
                 addresses: Sequence[str] | None = None, context: Any = None):
        if addresses is None:
            if address not in ("inproc", "tcp"):
                raise ValueError(f"address must be 'inproc' or 'tcp' (or give addresses), got {address!r}")
            name = f"psar-{os.getpid()}-{next(_names)}"
            addresses = [f"inproc://{name}-shard{s}" if address == "inproc" else "tcp://127.0.0.1:*"
                         for s in range(layout.num_shards)]
        if len(addresses) != layout.num_shards:
            raise ValueError(f"{len(addresses)} addresses for {layout.num_shards} shards")
        self.config, self.context = config, context
        self._new_server = lambda s: ShardServer(s, layout, split_values(layout, params, s), make_optimizer,
                                                 mode, num_workers, config)
        self.servers = [self._new_server(s) for s in range(layout.num_shards)]
        self._curve = load_server_keys(config.curve_dir) if config.curve_dir else None
        self.transports: list[ServerTransport] = []
        try:
            for a in addresses:
                self.transports.append(self._bind(a))
        except Exception:
            self._close_transports()
            raise
        self.addresses = [t.address for t in self.transports]
        self.results: dict[int, str] = {}
        self._stops = [threading.Event() for _ in self.servers]
        self.threads = [self._start(s) for s in range(layout.num_shards)]

    def _bind(self, address: str) -> ServerTransport:
        return ServerTransport(address, self.config.max_message_bytes, self.config.timeout_s, self.context,
                               curve=self._curve)

    def _start(self, s: int) -> threading.Thread:
        thread = threading.Thread(target=self._serve, args=(s,), name=f"ps-shard-{s}", daemon=True)
        thread.start()
        return thread

    def restart(self, s: int, timeout_s: float = 10.0) -> None:
        """Stop shard s and start a new one on its address from its state, as `psar server
        --resume` does from a checkpoint: same values and clocks, no workers joined."""
        self._stops[s].set()
        self.threads[s].join(timeout_s)
        self.transports[s].close()
        state = self.servers[s].state_dict()
        self.servers[s] = self._new_server(s)
        self.servers[s].load_state_dict(state)
        deadline = time.monotonic() + timeout_s
        while True:  # zmq lets go of the old socket's port in its own I/O thread, a moment later
            try:
                self.transports[s] = self._bind(self.addresses[s])
                break
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._stops[s] = threading.Event()
        self.threads[s] = self._start(s)

    def _serve(self, s: int) -> None:
        try:
            self.results[s] = self.servers[s].serve(self.transports[s], self._stops[s])
        except BaseException as e:  # recorded so that a test sees it rather than a silent thread
            log.exception("shard %d: serve loop failed", s)
            self.results[s] = f"crashed: {type(e).__name__}: {e}"

    def client(self, worker: int, **kwargs: Any) -> PSClient:
        """A PSClient for worker, with the cluster's timeouts and curve_dir unless given."""
        kwargs.setdefault("timeout_s", self.config.timeout_s)
        kwargs.setdefault("curve_dir", self.config.curve_dir)
        kwargs.setdefault("heartbeat_s", self.config.heartbeat_s)
        kwargs.setdefault("compression", self.config.compression)
        kwargs.setdefault("context", self.context)
        return PSClient(self.addresses, worker, **kwargs)

    def join(self, timeout_s: float = 10.0) -> bool:
        """Wait for every serve loop to end on its own; True if they all did."""
        for t in self.threads:
            t.join(timeout_s)
        return not any(t.is_alive() for t in self.threads)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the serve loops and close the sockets."""
        for stop in self._stops:
            stop.set()
        self.join(timeout_s)
        self._close_transports()

    def _close_transports(self) -> None:
        for t in self.transports:
            t.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
