"""The optimizer state of keys on the wire: a 'state' request's reply and a 'load' request.

A key's optimizer state is what torch's optimizer keeps for its chunk (its `state[chunk]`),
slot by slot: the tensors shaped like the key (SGD's momentum_buffer, Adam's exp_avg and
exp_avg_sq, Adagrad's sum), which travel flat in the key's dtype, and the scalars (Adam's and
Adagrad's step), which travel as 0-d float32 or float64 tensors. Header field 'slots' has one
list of slot names per key (empty: no state yet); 'dtypes' and 'shapes' describe every frame,
in key order and, within a key, in its slots' order. Only the names of STATE_SLOTS travel, and
each frame must be exactly what its slot and the layout say, before a tensor is built.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ps.layout import ITEMSIZE, TORCH_DTYPES, Layout
from ps.protocol_checks import _check_int_list, _fail, _tensor
from ps.protocol_schema import _PARAM_NAMES, Limits, Message

STATE_SLOTS = {"momentum_buffer": "key", "exp_avg": "key", "exp_avg_sq": "key", "max_exp_avg_sq": "key",
               "sum": "key", "step": "scalar"}
"""The state the shards' optimizers keep per chunk (SGD, Adam, AdamW, Adagrad): shaped like the
key, or a scalar."""
SCALAR_DTYPES = ("float32", "float64")

Slots = Sequence[tuple[str, torch.Tensor]]
"""One key's state: (slot name, tensor) pairs, tensors flat (the key's numel) or 0-d."""


def state_fields(states: Sequence[Slots]) -> tuple[dict, list[torch.Tensor]]:
    """(header fields, frames) of the keys' states, in order, for encode: 'slots', 'dtypes',
    'shapes' and one tensor per slot."""
    names, frames = [], []
    for slots in states:
        names.append([name for name, _ in slots])
        frames.extend(t.reshape(-1) if STATE_SLOTS.get(name) == "key" else t.reshape(()) for name, t in slots)
    try:
        dtypes = [_PARAM_NAMES[t.dtype] for t in frames]
    except KeyError as e:
        raise ValueError(f"optimizer state of dtype {e.args[0]} cannot travel; expected one of "
                         f"{sorted(_PARAM_NAMES.values())}") from None
    return {"slots": names, "dtypes": dtypes, "shapes": [list(t.shape) for t in frames]}, frames


def _expected(k: int, name: str, layout: Layout) -> tuple[tuple[str, ...], list[int]]:
    kind = STATE_SLOTS.get(name) if isinstance(name, str) else None
    if kind is None:
        _fail(f"key {k}: optimizer state slot {str(name)[:40]!r}; expected one of {sorted(STATE_SLOTS)}")
    return ((layout.key_dtype[k],), layout.key_wire_shape[k]) if kind == "key" else (SCALAR_DTYPES, [])


def decode_slots(h: dict, keys: list[int], views: list[memoryview], layout: Layout | None,
                 limits: Limits) -> Message:
    """A message with 'slots': every frame checked against its slot and the layout; the
    Message's parts hold each key's tensors (in its slots' order)."""
    if layout is None:
        _fail("optimizer state ('slots') needs the layout (join first)")
    if "rows" in h or "parts" in h or "meta" in h:
        _fail("optimizer state ('slots') comes whole: no 'rows', 'parts' or 'meta'")
    slots = _check_int_list(h, "slots", limits.max_keys)
    dtypes, shapes = _check_int_list(h, "dtypes", limits.max_keys), _check_int_list(h, "shapes", limits.max_keys)
    if len(slots) != len(keys):
        _fail(f"header field 'slots' has {len(slots)} entries for {len(keys)} keys")
    forms = []
    for k, names in zip(keys, slots):
        if not isinstance(names, list) or len(names) > len(STATE_SLOTS) or len(set(map(repr, names))) != len(names):
            _fail(f"key {k}: slots {str(names)[:80]}; expected a list of distinct names from {sorted(STATE_SLOTS)}")
        forms.append([_expected(k, name, layout) for name in names])
    total = sum(len(f) for f in forms)
    if not len(dtypes) == len(shapes) == total == len(views):
        _fail(f"optimizer state of {total} slot(s) has {len(dtypes)} dtypes, {len(shapes)} shapes and "
              f"{len(views)} tensor frame(s); expected equal counts")
    parts, at = [], 0
    for k, names, expected in zip(keys, slots, forms):
        tensors = []
        for name, (allowed, shape) in zip(names, expected):
            dtype, got, view = dtypes[at], shapes[at], views[at]
            at += 1
            if dtype not in allowed or got != shape:
                _fail(f"key {k}: optimizer state {name!r} is {dtype!r} {got}; expected {' or '.join(allowed)} {shape}")
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            if nbytes > limits.max_tensor_bytes or view.nbytes != nbytes:
                _fail(f"key {k}: optimizer state {name!r} frame is {view.nbytes} bytes; expected {nbytes}")
            tensors.append(_tensor(view, TORCH_DTYPES[dtype], shape))
        parts.append(tuple(tensors))
    return Message(h, [t for p in parts for t in p], [], parts)


def states_of(msg: Message) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """{key id: [(slot name, tensor)]} of a decoded message with 'slots'."""
    return {k: list(zip(names, tensors)) for k, names, tensors in zip(msg.keys, msg.get("slots"), msg.parts)}
