"""The wire format's schema (ps/protocol.py's docstring says what each field means): the ops,
which header fields each may carry, the dtypes a frame may hold, and the Message a decoded
frame list becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ps.layout import TORCH_DTYPES

PROTOCOL_VERSION = 1
REQUESTS = ("init", "join", "push", "pull", "wait", "norm", "heartbeat", "stats", "checkpoint", "shutdown", "leave",
            "state", "load")
REPLIES = ("ok", "error")
OPS = REQUESTS + REPLIES

# op -> (required fields beyond op/v/worker/req, optional fields)
_TENSORS = {"keys", "dtypes", "shapes"}
OP_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    "init": ({"body"} | _TENSORS, set()),
    "join": (set(), {"settings", "rejoin"}),
    "push": ({"step", "version"} | _TENSORS, {"rows", "pull", "min_version", "clock", "lr", "hold", "parts", "meta"}),
    "pull": ({"keys"}, {"min_version", "clock", "wait_left", "rows", "scale"}),
    "wait": ({"min_version"}, set()),
    "norm": ({"step"}, set()),
    "heartbeat": (set(), set()),
    "stats": (set(), set()),
    "checkpoint": (set(), set()),
    "shutdown": (set(), set()),
    "leave": (set(), set()),
    "state": ({"keys"}, set()),
    "load": ({"slots"} | _TENSORS, set()),
    "ok": (set(), {"step", "version", "staleness", "body", "waited_us", "rows", "sq", "parts", "meta", "slots"} | _TENSORS),
    "error": ({"error"}, {"code"}),
}
BASE_FIELDS = ("op", "v", "worker", "req")
_INT_FIELDS = ("worker", "req", "step", "version", "min_version", "clock", "staleness", "wait_left", "pull",
               "waited_us", "hold", "rejoin")
_FLOAT_FIELDS = ("lr", "scale", "sq")  # finite numbers >= 0
_MAX_INT = 1 << 62
_ALLOWED = {op: frozenset(BASE_FIELDS) | required | optional for op, (required, optional) in OP_FIELDS.items()}
_INT_SET = frozenset(_INT_FIELDS)
_BASE_SET = frozenset(BASE_FIELDS)
_RARE_FIELDS = frozenset(("error", "code", "body", "settings", "hold", "rejoin") + _FLOAT_FIELDS)


FRAME_DTYPES = {**TORCH_DTYPES, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
                "uint8": torch.uint8}
"""What a frame may hold: the parameters' dtypes, and a compressed message's indices, levels
and packed bits."""
FRAME_ITEMSIZE = {name: torch.empty(0, dtype=d).element_size() for name, d in FRAME_DTYPES.items()}
_FRAME_NAMES = {d: name for name, d in FRAME_DTYPES.items()}
_PARAM_NAMES = {d: name for name, d in TORCH_DTYPES.items()}

MAX_PARTS = 8
"""Most frames one compressed key's message may have (and ints in its 'meta')."""

MODES = ("sync", "async", "ssp")
"""The shards' consistency rules (ps.shard.consistency), as a join's reply names them."""

ERROR_CODES = ("not_joined", "not_initialized")
"""What an error reply's optional 'code' may say, where a client acts on the kind of error
(rejoin a shard that restarted; wait for worker 0's init): matched by code, never by text."""


class ProtocolError(ValueError):
    """A message that does not fit the protocol or the layout; the text names the field."""


@dataclass(frozen=True)
class Limits:
    """Bounds applied while decoding, before anything is allocated from the message."""

    max_header_bytes: int = 1 << 20
    max_keys: int = 1 << 16
    max_str_len: int = 1 << 16
    max_map_len: int = 1 << 12
    max_tensor_bytes: int = 1 << 30

    def unpack_options(self) -> dict:
        """msgpack.unpackb's options for a header within these bounds: str keys, lists, no
        binary or extension types."""
        return dict(raw=False, strict_map_key=True, use_list=True, max_str_len=self.max_str_len, max_bin_len=0,
                    max_ext_len=0, max_array_len=self.max_keys, max_map_len=self.max_map_len)


class Message:
    """A decoded message: the header dict and one tensor per entry of header['keys'] (if any).

    ids: per key, the row ids it names (int64) or None for the whole key; empty without
    'rows'. parts: per key of a compressed message, its frames (checked against the codec);
    empty without 'parts' ('tensors' then holds every frame in order)."""

    __slots__ = ("header", "tensors", "ids", "parts")

    def __init__(self, header: dict[str, Any], tensors: list[torch.Tensor] | None = None,
                 ids: list[torch.Tensor | None] | None = None,
                 parts: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        self.header = header
        self.tensors = [] if tensors is None else tensors
        self.ids = [] if ids is None else ids
        self.parts = [] if parts is None else parts

    def __repr__(self) -> str:
        return f"Message({self.header!r}, {len(self.tensors)} tensors)"

    @property
    def op(self) -> str:
        return self.header["op"]

    @property
    def worker(self) -> int:
        return self.header["worker"]

    @property
    def req(self) -> int:
        return self.header["req"]

    @property
    def keys(self) -> list[int]:
        return self.header.get("keys", [])

    def get(self, name: str, default: Any = None) -> Any:
        return self.header.get(name, default)
