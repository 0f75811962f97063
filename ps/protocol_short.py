"""The short way to read the two messages a push+pull is made of: the push of whole keys (a
shard reads it, ps.shard.fastpath) and the reply carrying their values (a worker reads it).

ps.protocol.decode reads any message and names what is wrong with it. Both readers here
accept a message only where decode would, in a fraction of its calls (a 1 KiB push+pull
spent about a third of its time in them on a core that had just slept in a poll): keys are
checked against a table of the layout's whole keys built once, the header's fields against
the few a push+pull carries. Anything else (rows, compression, another dtype, any field or
value out of place) gives None, and the caller reads the message with decode, which
accepts it or says why not. tests/unit/test_protocol_short.py holds them to decode's word.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgpack
import torch

from ps.layout import ITEMSIZE, TORCH_DTYPES, Layout
from ps.protocol_schema import _MAX_INT, PROTOCOL_VERSION, Limits, Message

_REPLY = frozenset(("v", "op", "worker", "req", "version", "keys", "staleness", "waited_us", "dtypes", "shapes"))


class WholeKeys:
    """keys of layout, each sent whole in its own dtype: for each, the dtype name, shape and
    bytes its frame must have."""

    def __init__(self, layout: Layout, keys: Iterable[int], limits: Limits = Limits()) -> None:
        self.table: dict[int, tuple[str, list[int], int, torch.dtype]] = {}
        for k in keys:
            dtype, shape = layout.key_dtype[k], layout.key_wire_shape[k]
            nbytes = shape[0] * ITEMSIZE[dtype]
            if 0 < nbytes <= limits.max_tensor_bytes:  # an empty frame is decode's to read
                self.table[k] = (dtype, shape, nbytes, TORCH_DTYPES[dtype])
        self._unpack = limits.unpack_options()
        self._max_header = limits.max_header_bytes

    def header(self, frames: list) -> dict | None:
        """The header of frames, if it is a msgpack map within the limits decode applies."""
        if not frames or type(frames[0]) is not bytes or len(frames[0]) > self._max_header:
            return None
        try:
            h = msgpack.unpackb(frames[0], **self._unpack)
        except Exception:
            return None
        return h if type(h) is dict else None

    def tensors(self, h: dict, frames: list) -> list[torch.Tensor] | None:
        """The tensors of frames[1:], one per key of h's 'keys', each on its frame (no copy),
        if every key is in the table, named once, with its dtype and shape, and its frame a
        writable byte view of its size; None otherwise."""
        keys, dtypes, shapes = h["keys"], h["dtypes"], h["shapes"]
        if type(keys) is not list or not keys or type(dtypes) is not list or type(shapes) is not list \
                or not len(keys) == len(dtypes) == len(shapes) == len(frames) - 1:
            return None
        table, out = self.table, []
        for i, k in enumerate(keys):
            e = table.get(k) if type(k) is int else None
            view = frames[i + 1]
            if e is None or dtypes[i] != e[0] or shapes[i] != e[1] or type(shapes[i][0]) is not int \
                    or type(view) is not memoryview or view.nbytes != e[2] or view.readonly \
                    or view.ndim != 1 or view.format != "B":
                return None
            out.append(torch.frombuffer(view, dtype=e[3]))
        if len(keys) > 1 and len(set(keys)) != len(keys):
            return None
        return out


def ints(*values: Any) -> bool:
    """Whether every value is an int header field decode accepts (None: a field not sent)."""
    for x in values:
        if x is not None and (type(x) is not int or not 0 <= x < _MAX_INT):
            return False
    return True


def decode_reply(frames: list, whole: WholeKeys) -> Message | None:
    """An 'ok' reply carrying the values of whole keys of whole's table (a push+pull's or a
    pull's), as decode would read it; None: read it with decode."""
    h = whole.header(frames)
    if h is None or not h.keys() <= _REPLY or h.get("op") != "ok" or h.get("v") != PROTOCOL_VERSION \
            or "worker" not in h or "req" not in h or "keys" not in h or "dtypes" not in h or "shapes" not in h:
        return None
    if not ints(h["v"], h["worker"], h["req"], h.get("version"), h.get("staleness"), h.get("waited_us")):
        return None
    tensors = whole.tensors(h, frames)
    return None if tensors is None else Message(h, tensors)
