"""Wire format: one msgpack header frame, then one raw frame per tensor. No zmq here.

Everything in a message is validated against the layout before any tensor is built, so a
malformed or hostile message raises ProtocolError and touches nothing. Tensors are then
built on the received frames without a copy (torch.frombuffer).

Row-sparse keys (embedding tables): a push, a pull or a pull's reply may name some rows of a
key instead of the whole key. Header field 'rows' then has one entry per key: -1 for the
whole key, or n >= 0 rows, whose ids (int64, strictly increasing, within the key's rows,
counted from the key's first row) come in a frame of their own just before the key's values
frame; the values are shaped [n, dim]. A pull names rows with ids frames and no values.

A push with 'pull' set (1) asks, in the same message, for the values of the keys it pushes:
the reply is the reply to a pull of those keys under the push's own 'min_version' and
'clock' conditions (with the push's 'staleness' beside them), and takes the place of the
push's plain 'ok'. One message each way per step instead of two; whole keys only.

A push may carry 'lr': the learning rate the worker's schedule gives its step (a script's
torch.optim.lr_scheduler on job.optimizer); the shard updates those keys with it.

Clipping by the global norm (sync): a step's pushes carry 'hold' (1), and the shard keeps
the averaged gradient instead of updating; a 'norm' for that 'step' is answered once every
key is in, with 'sq', the sum of squares of this shard's averaged gradient; every worker
adds the shards' sums, and its pull of the step's values carries 'scale', the clip
coefficient, with which the first such pull makes the update (later ones must agree).

Compressed keys (compress.method, see ps.codec): a push's gradients, or a sync pull's reply's
gradient the update of its version applied, may travel compressed. Header field 'parts'
then gives, per key, how many frames its message has, and 'meta' the small ints of its header
(random-k's index seed and k); 'dtypes' and 'shapes' describe every frame, in key order. The
receiver's codec says which frames a key's message must have; anything else is refused
before a tensor is built. Whole keys only: a message has 'rows' or 'parts', never both.

A 'state' asks a shard for the optimizer state of some of its keys; the reply carries it as
ps/protocol_state.py says ('slots'). A 'load', from worker 0, carries the state of every key
of the shard in the same form, and replaces the shard's.

A 'wait' carries no keys: the shard answers it ('ok' with its version, no values) once it has
finished the sync step to 'min_version', every key updated. A worker that pulls only after
every shard answered its wait never has a pull's reply compete with a push for a link.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Collection, Sequence

import msgpack
import torch

from ps.layout import ITEMSIZE, TORCH_DTYPES, Layout, dtype_name
from ps.protocol_checks import (_check_int, _check_int_list, _check_rare, _check_rows, _decode_parts, _fail,
                                _first_bad_key, _ids, _row_ids, _tensor, _tensor_bytes)
from ps.protocol_schema import (_ALLOWED, _BASE_SET, _FRAME_NAMES, _INT_SET, _MAX_INT, _PARAM_NAMES,  # noqa: F401
                                _RARE_FIELDS, _TENSORS, BASE_FIELDS, ERROR_CODES, FRAME_DTYPES, FRAME_ITEMSIZE,
                                MAX_PARTS, MODES, OP_FIELDS, OPS, PROTOCOL_VERSION, REPLIES, REQUESTS, Limits,
                                Message, ProtocolError)
from ps.protocol_state import decode_slots


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU contiguous tensor, as a view (no copy)."""
    if not t.is_cpu:
        raise ValueError(f"tensor on {t.device} must be moved to the CPU before it is sent")
    if not t.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous() first")
    dtype = t.dtype
    if dtype not in _FRAME_NAMES:
        raise ValueError(f"dtype {dtype} cannot travel; expected one of {sorted(FRAME_DTYPES)}")
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 1:
        t = t.reshape(-1)
    return _raw(t)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a flat, contiguous CPU tensor without autograd, as a view."""
    return memoryview(as_array(t)).cast("B")


def as_array(t: torch.Tensor):
    """A numpy view of a contiguous CPU tensor without autograd (bfloat16 as int16, the same
    bits: numpy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()


def encode(header: dict[str, Any], tensors: Sequence[torch.Tensor] | None = None,
           ids: Sequence[torch.Tensor | None] | None = None,
           parts: Sequence[tuple[Sequence[torch.Tensor], Sequence[int]]] | None = None) -> list[bytes | memoryview]:
    """[msgpack header, raw tensor frames...]. With tensors (even none), header['keys'] must
    name one key per tensor; 'dtypes' and 'shapes' are filled in from the tensors. ids: per
    key, the int64 row ids it names, or None for the whole key ('rows' is filled in).
    parts, instead of tensors: per key, a compressed message's (frames, header ints)."""
    header = {"v": PROTOCOL_VERSION, **header}
    if "slots" in header:  # optimizer state: the header has its fields (ps.protocol_state.state_fields)
        return [msgpack.packb(header, use_bin_type=True), *(tensor_frame(t) for t in tensors)]
    n = len(header.get("keys", ()))
    if parts is not None:
        if n != len(parts) or tensors is not None or ids is not None:
            raise ValueError(f"header names {n} keys for {len(parts)} compressed messages (and no tensors or ids)")
        header["parts"] = [len(frames) for frames, _ in parts]
        header["meta"] = [[int(i) for i in meta] for _, meta in parts]
        tensors = [f for frames, _ in parts for f in frames]
        header["dtypes"] = [_FRAME_NAMES[t.dtype] for t in tensors]
        header["shapes"] = [list(t.shape) for t in tensors]
        return [msgpack.packb(header, use_bin_type=True), *(tensor_frame(t) for t in tensors)]
    if tensors is not None:
        if n != len(tensors):
            raise ValueError(f"header names {n} keys for {len(tensors)} tensors")
        try:
            header["dtypes"] = [_PARAM_NAMES[t.dtype] for t in tensors]
        except KeyError:  # the error names the dtype
            header["dtypes"] = [dtype_name(t.dtype) for t in tensors]
        header["shapes"] = [[*t.shape] for t in tensors]
    if ids is None:
        return [msgpack.packb(header, use_bin_type=True), *(tensor_frame(t) for t in tensors or ())]
    if n != len(ids):
        raise ValueError(f"header names {n} keys for {len(ids)} row id lists")
    header["rows"] = [-1 if i is None else i.numel() for i in ids]
    frames = []
    for k in range(n):
        if ids[k] is not None:
            if ids[k].dtype != torch.int64:
                raise ValueError(f"row ids must be int64, got {ids[k].dtype}")
            frames.append(memoryview(ids[k].contiguous().numpy()).cast("B"))
        if tensors is not None:
            frames.append(tensor_frame(tensors[k]))
    return [msgpack.packb(header, use_bin_type=True), *frames]


def encode_whole(header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """encode's frames of whole keys whose 'dtypes' and 'shapes' the header already names,
    as flat, contiguous CPU tensors without autograd (PSClient.push made each so, and
    checked it against the layout): without encode's look at every tensor."""
    return [pack_header(header), *map(_raw, tensors)]


def pack_header(header: dict[str, Any]) -> bytes:
    """A message's header frame (the protocol version first): encode_whole's, and a shard's
    reply whose frames are its keys' bytes (ps.shard.snapshots.SnapshotPool.reply_bytes).
    msgpack.packb makes a Packer, and its buffer, every call (2.6 us against 1.1 for a
    push's header in a loop): each thread keeps one."""
    try:
        pack = _packers.pack
    except AttributeError:  # this thread's first header
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
    return pack({"v": PROTOCOL_VERSION, **header})


_packers = threading.local()


def pull_of(h: dict[str, Any]) -> Message:
    """The pull a push+pull's header (h) asks for: its keys' values under its own min_version
    and clock."""
    pull = {"op": "pull", "v": h["v"], "worker": h["worker"], "req": h["req"], "keys": h["keys"]}
    for f in ("min_version", "clock"):
        if h.get(f) is not None:
            pull[f] = h[f]
    return Message(pull)


def error_reply(worker: int, req: int, message: str, code: str | None = None) -> list[bytes]:
    if code is not None and code not in ERROR_CODES:
        raise ValueError(f"error code {code!r}: expected one of {ERROR_CODES}")
    return encode({"op": "error", "worker": worker, "req": req, "error": message,
                   **({"code": code} if code is not None else {})})


def peek_ids(frames: Sequence[Any]) -> tuple[int, int]:
    """(worker, req) of a message that failed to decode, best effort, -1 where unknown:
    so that an error reply can still be matched to its request."""
    try:
        h = msgpack.unpackb(frames[0], raw=False, max_bin_len=0, max_ext_len=0)
        ids = tuple(h.get(f) for f in ("worker", "req"))
        return tuple(x if type(x) is int and 0 <= x < _MAX_INT else -1 for x in ids)
    except Exception:
        return -1, -1


def _frame_view(f: Any) -> memoryview:
    mv = f.buffer if hasattr(f, "buffer") else memoryview(f)  # zmq.Frame or any buffer
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def decode(frames: Sequence[Any], layout: Layout | None = None, known_workers: Collection[int] | None = None,
           limits: Limits = Limits(), *, shard: int | None = None, wire: str | None = None,
           codec: Any = None) -> Message:
    """Validate a message completely, then build its tensors on the frames (zero copy).

    Args:
        frames: header frame then tensor frames (bytes, memoryview or zmq.Frame).
        layout: keys, dtypes and shapes are checked against it; None checks only that they
            are self-consistent (a client reading the join reply, before it has a layout).
        known_workers: worker ids accepted; None accepts any.
        limits: size bounds.
        shard: if given, every key must belong to this shard.
        wire: a dtype name accepted for every key besides the layout's (ps.compression).
        codec: what a compressed key's frames must be: codec.forms(key, meta) -> [(dtype
            name, shape list)], ValueError for a meta it refuses (ps.codec); None: compressed
            messages are refused.
    Raises ProtocolError naming the field, its value and what was expected.
    """
    if not frames:
        _fail("empty message: expected a header frame")
    try:
        views = [_frame_view(f) for f in frames]
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"message frames must be byte buffers: {e}") from e
    head = views[0]
    if head.nbytes > limits.max_header_bytes:
        _fail(f"header frame is {head.nbytes} bytes; at most {limits.max_header_bytes} allowed")
    try:
        h = msgpack.unpackb(head, **limits.unpack_options())
    except Exception as e:
        _fail(f"header frame is not valid msgpack within limits: {type(e).__name__}: {e}")
    if not isinstance(h, dict):
        _fail(f"header is a {type(h).__name__}; expected a dict (msgpack map)")
    fields = h.keys()
    if not _BASE_SET <= fields:
        _fail(f"header lacks field(s) {[f for f in BASE_FIELDS if f not in h]}; every message needs "
              f"{list(BASE_FIELDS)}")
    if h["v"] != PROTOCOL_VERSION or type(h["v"]) is not int:
        _fail(f"header field 'v' (protocol version) is {h['v']!r}; expected {PROTOCOL_VERSION}")
    op = h["op"]
    if type(op) is not str or op not in _ALLOWED:
        _fail(f"header field 'op' is {op!r}; expected one of {list(OPS)}")
    if not fields <= _ALLOWED[op]:
        extra = sorted(fields - _ALLOWED[op], key=repr)
        _fail(f"header field(s) {extra} not allowed in a {op!r} message; allowed: {sorted(_ALLOWED[op])}")
    required = OP_FIELDS[op][0]
    if not required <= fields:
        _fail(f"a {op!r} message needs header field(s) {sorted(required - fields)}")
    for name in _INT_SET.intersection(fields):
        value = h[name]
        if type(value) is not int or not 0 <= value < _MAX_INT:
            _check_int(h, name, -1 if op == "error" and name in ("worker", "req") else 0)
    if known_workers is not None and h["worker"] not in known_workers and not (op == "error" and h["worker"] == -1):
        _fail(f"header field 'worker' is {h['worker']}; not a known worker (known: {_ids(known_workers)})")
    if not fields.isdisjoint(_RARE_FIELDS):
        _check_rare(h, limits)

    keys = h["keys"] if "keys" in h else []
    if type(keys) is not list or len(keys) > limits.max_keys:
        _check_int_list(h, "keys", limits.max_keys)
    if any(type(k) is not int for k in keys) or len(keys) > 1 and len(set(keys)) != len(keys):
        _first_bad_key(keys)
    if layout is not None:
        n_keys, key_shard = len(layout.keys), layout.key_shard
        for k in keys:
            if not 0 <= k < n_keys:
                _fail(f"key {k} is not in the layout (keys 0..{n_keys - 1})")
            if shard is not None and key_shard[k] != shard:
                _fail(f"key {k} belongs to shard {key_shard[k]}, not to this shard {shard}")
    if "slots" in h:
        if not _TENSORS <= fields:
            _fail("optimizer state ('slots') needs header fields 'keys', 'dtypes' and 'shapes'")
        return decode_slots(h, keys, views[1:], layout, limits)
    by_rows = "rows" in h
    rows = _check_rows(h, keys, layout, limits) if by_rows else itertools.repeat(-1)  # whole keys
    if h.get("pull") not in (None, 0, 1):
        _fail(f"header field 'pull' is {h['pull']}; expected 0 or 1")
    n_ids = sum(n >= 0 for n in rows) if by_rows else 0
    if n_ids and h.get("pull"):
        _fail("a push by rows cannot ask for values ('pull'): pull the rows in a pull")
    has_tensors = "dtypes" in h or "shapes" in h
    if has_tensors and not _TENSORS <= fields:
        _fail("tensor frames need header fields 'keys', 'dtypes' and 'shapes' together")
    if not has_tensors:
        if len(frames) != 1 + n_ids:
            _fail(f"a {op!r} message without tensors has {len(frames) - 1 - n_ids} extra frame(s) "
                  f"(besides {n_ids} row id frame(s))")
        return Message(h, [], _row_ids(keys, rows, views[1:], layout) if by_rows else [])

    dtypes, shapes = _check_int_list(h, "dtypes", limits.max_keys), _check_int_list(h, "shapes", limits.max_keys)
    if "parts" in h or "meta" in h:
        return _decode_parts(h, keys, dtypes, shapes, views[1:], layout, limits, codec)
    if not len(keys) == len(dtypes) == len(shapes):
        _fail(f"header has {len(keys)} keys, {len(dtypes)} dtypes, {len(shapes)} shapes; expected equal counts")
    if len(frames) - 1 != len(keys) + n_ids:
        _fail(f"message has {len(frames) - 1 - n_ids} tensor frame(s) for {len(keys)} key(s) "
              f"(besides {n_ids} row id frame(s))")
    sizes = []
    whole = layout is not None and not by_rows  # a key as the layout has it needs no further look
    for k, dtype, shape, n in zip(keys, dtypes, shapes, rows):
        if whole and shape == layout.key_wire_shape[k] and type(shape[0]) is int \
                and (dtype == layout.key_dtype[k] or dtype == wire is not None):
            nbytes = shape[0] * ITEMSIZE[dtype]
        else:
            nbytes = _tensor_bytes(k, dtype, shape, n, layout, wire)
        if nbytes > limits.max_tensor_bytes:
            _fail(f"key {k}: tensor of {nbytes} bytes exceeds the limit of {limits.max_tensor_bytes}")
        sizes.append(nbytes)
    views, id_views = views[1:], []
    if by_rows:  # per key: [ids frame], values frame
        values = []
        for n in rows:
            if n >= 0:
                id_views.append(views.pop(0))
            values.append(views.pop(0))
        views = values
    for k, nbytes, view in zip(keys, sizes, views):
        if view.nbytes != nbytes:
            _fail(f"key {k}: tensor frame is {view.nbytes} bytes; expected {nbytes} (numel * itemsize)")
    ids = _row_ids(keys, rows, id_views, layout) if by_rows else []
    tensors = [_tensor(v, TORCH_DTYPES[d], s) for v, d, s in zip(views, dtypes, shapes)]
    return Message(h, tensors, ids)

