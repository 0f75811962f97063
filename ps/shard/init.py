"""A shard started without a model (a user's script) waits for worker 0's init.

init carries body {"layout": Layout.to_wire(), "optim": {name: scalar}} and the initial
values of this shard's keys, checked against that layout like any push. Every other request
gets an error with code "not_initialized" (a client's join retries on it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ps.layout import Layout
from ps.protocol import Limits, ProtocolError, decode, encode, error_reply, peek_ids

log = logging.getLogger("psar.ps.server")


class _NotInitialized(ProtocolError):
    """A request other than init to a shard that has no model yet."""


def await_init(transport: Any, shard: int, num_shards: int,
               make: Callable[[Layout, dict[int, torch.Tensor], dict[str, Any]], Any],
               timeout_s: float, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
               stop_event: threading.Event | None = None) -> Any:
    """Serve until worker 0's init arrives. make(layout, values, optim) builds the ShardServer
    (a ValueError from it, e.g. an optimizer it cannot run, is the error reply). Returns it
    once init is answered; None if stop_event is set. TimeoutError after timeout_s without
    an init, naming worker 0.
    """
    deadline = clock() + timeout_s
    while not (stop_event is not None and stop_event.is_set()):
        if clock() > deadline:
            raise TimeoutError(f"shard {shard}: worker 0 sent no init (its model's layout and initial "
                               f"values) within {timeout_s:g} s; is the script calling attach()?")
        item = transport.recv(0.1)
        if item is None:
            continue
        peer, frames = item
        try:
            server = _init_from(frames, shard, num_shards, make, limits)
        except (ProtocolError, ValueError, TypeError) as e:
            code = "not_initialized" if isinstance(e, _NotInitialized) else None
            transport.send(peer, error_reply(*peek_ids(frames), f"shard {shard}: {e}", code))
            continue
        msg = decode(frames, server.layout, limits=limits, shard=shard)
        transport.send(peer, encode({"op": "ok", "worker": msg.worker, "req": msg.req}))
        log.info("shard %d: initialized by worker 0 with %r", shard, server.layout)
        return server
    return None


def _init_from(frames: Sequence[Any], shard: int, num_shards: int, make, limits: Limits) -> Any:
    msg = decode(frames, None, limits=limits)
    if msg.op != "init":
        raise _NotInitialized(f"this shard has no model yet: worker 0 sends it first (init); {msg.op} must wait")
    if msg.worker != 0:
        raise ProtocolError(f"init comes from worker 0, not worker {msg.worker}")
    body = msg.get("body")
    if set(body) != {"layout", "optim"} or not isinstance(body["optim"], dict):
        raise ProtocolError(f"init body must hold 'layout' and 'optim' (a dict); got {sorted(body)}")
    try:
        layout = Layout.from_wire(body["layout"])
    except ValueError as e:
        raise ProtocolError(f"init: invalid layout: {e}") from e
    if layout.num_shards != num_shards:
        raise ProtocolError(f"init: the layout has {layout.num_shards} shards, this run {num_shards}")
    msg = decode(frames, layout, limits=limits, shard=shard)  # keys, dtypes, shapes, frame sizes
    expected = [k.id for k in layout.shard_keys(shard)]
    if msg.keys != expected:
        raise ProtocolError(f"init: values for keys {msg.keys[:8]}, expected this shard's keys {expected[:8]}")
    return make(layout, dict(zip(msg.keys, msg.tensors)), body["optim"])
