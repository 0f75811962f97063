"""A worker's compiled lane (ps/_client.c, built with psar) for the messages it sends and
takes most: a push or push+pull of whole dense float keys (frames up to 64 KiB copied into
ZeroMQ's messages, as pyzmq copies them; larger ones lent, without pyzmq's collector thread,
which takes the GIL to let each go), and an 'ok' reply carrying whole keys.

Why: one at a time, a worker's push+pull of 1 KiB held its core about 65 us in push and 80
us in wait on this 2-core machine, where the same messages written and read with a dozen
Python calls took 27 and 37 us; in psar bench's loop, push+pull / ZeroMQ at 1 to 64 KiB was
0.39-0.55 against 0.58-0.82 for those (docs/results.md, "A worker's compiled lane"). The time
was spread over every layer (the Handle, the transport's send, the poll set, the reply's
checks, the Result), each costing several times on a core that has just slept in a poll what
it does in a loop. The lane writes a push's header and sends its frames in one call, and
takes a reply (poll, receive, the checks of ps.protocol_short.decode_reply, the Message on
ZeroMQ's buffers) in another, on the sockets of the worker's transports, calling the libzmq
that pyzmq calls.

Under a window of push+pulls (ps.window_mb: ps-sync's workers) it sends those the window
would send at once: nothing held for any of their shards, and room for the keys' bytes and
the largest header the lane writes (ps.client_window's _window_open); the window counts each
message's bytes as it counts the Python path's. One it would hold back, the Python path holds.

Anything else it leaves to the Python paths, unchanged: a push it does not take it returns
before it has sent anything (a tensor that needs grad, is not contiguous, lies on another
device, another dtype, rows, compression, a transport whose monitor is due to be read), and
a reply it does not read it hands over as the transport would, for ps.protocol.decode to
read and name what is wrong.
tests/unit/test_client_compiled.py holds both ways to the same bytes on the wire and the same
results. PSAR_COMPILED=0 turns it off (a comparison).
"""

from __future__ import annotations

from typing import Any

import torch

from ps.flight import Handle
from ps.protocol_schema import _MAX_INT, PROTOCOL_VERSION, Message
from ps.transport import MONITOR_DRAIN_S
from ps.zmq_link import compiled_on, linked

try:
    import ps._client as _client
except ImportError:  # not built (a copy of the tree without `pip install -e .`): Python's paths
    _client = None

FORMATS = {"float32": ("f", 4), "float64": ("d", 8), "float16": ("e", 2)}
"""The dtypes the lane sends and reads: name -> (buffer format, item size)."""


def available() -> bool:
    """Whether the lane is built, not turned off (PSAR_COMPILED=0), and has libzmq's functions
    (those pyzmq calls: ps.zmq_link)."""
    return compiled_on() and linked(_client)


def lane_for(client: Any) -> Any:
    """The compiled lane of a joined PSClient, or None where it cannot have one: not built,
    compression (a wire dtype or a compressor), or no key it takes."""
    if not available() or client._wire is not None or client.codec is not None or client.layout is None \
            or not (type(client.worker) is int and 0 <= client.worker < _MAX_INT):
        return None
    layout = client.layout
    keys = []
    for k in range(len(layout.keys)):
        shard = layout.key_shard[k]
        entry = client._whole[shard].table.get(k)  # ps.protocol_short.WholeKeys: whole keys, their bytes
        if entry is None or entry[0] not in FORMATS:
            keys.append(None)
            continue
        dtype, shape, nbytes, torch_dtype = entry
        keys.append((shard, nbytes, *FORMATS[dtype], dtype, torch_dtype, list(shape)))
    if not any(keys):
        return None
    sockets = [t.socket for t in client._transports]
    return _client.Lane([s.underlying for s in sockets], sockets, keys, client.worker, PROTOCOL_VERSION, _MAX_INT,
                        client._limits.max_header_bytes, client._limits.max_keys, MONITOR_DRAIN_S, client._inflight,
                        client.versions, client._reqs, Handle, Message, torch.frombuffer, torch.Tensor)


SendFailed = _client.SendFailed if _client is not None else None
"""What the lane raises where a send failed: (shard, errno, bytes sent to shards before it,
{request id: bytes} of those messages)."""
