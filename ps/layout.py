"""Which server shard holds which chunk of which parameter: a pure, deterministic function.

A parameter is flattened and cut into contiguous chunks ("keys"); big tensors are split so
that every shard carries about the same number of bytes (as BytePS and ps-lite do), small
ones stay whole so they cost one frame. A row-sparse parameter (an embedding table, 2-D) is
cut on row boundaries only, so that each key holds whole rows [first_row, first_row + rows)
and a push or pull can name rows of a key by their index within it.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Sequence

import torch

WIRE_VERSION = 2
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
TORCH_DTYPES = {name: getattr(torch, name) for name in ITEMSIZE}
ROW_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
"""The modules whose weight a layout may hold by rows (row-sparse parameters)."""
MIN_CHUNK_ELEMS = 1 << 16
"""Tensors are spread over shards only down to chunks of this many elements: below it a
split costs more in per-frame overhead than it gains in balance; unless the model is so small
beside its shards that a quarter of each shard's even share is below it (then down to that
quarter, so that the greedy placement keeps every shard near its share)."""
MIN_SHARE_ELEMS = 1 << 12
"""However many shards, a tensor is cut only into pieces of more than half this many elements
(16 KiB of float32), unless there are fewer pieces than shards."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32; ValueError for a dtype the server cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {dtype} is not supported; expected one of {sorted(ITEMSIZE)}")
    return name


def chunk_elems_from_mb(chunk_mb: float, itemsize: int = 4) -> int:
    """Elements in a chunk of chunk_mb MiB of items of itemsize bytes (at least 1)."""
    return max(1, int(chunk_mb * (1 << 20)) // itemsize)


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the layout sees it: name, shape and dtype name ('float32', ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"parameter name must be a str, got {self.name!r}")
        shape = tuple(self.shape)
        if any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"parameter {self.name!r}: shape must be ints >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"parameter {self.name!r}: dtype {self.dtype!r} not one of {sorted(ITEMSIZE)}")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "ParamSpec":
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Key:
    """A contiguous chunk [offset, offset + numel) of the flattened parameter specs[param]."""

    id: int
    param: int
    offset: int
    numel: int
    shard: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Chunks travel flat."""
        return (self.numel,)


class Layout:
    """Parameters, their keys and the shard of each key. Build with build_layout or from_wire."""

    def __init__(self, specs: Sequence[ParamSpec], keys: Sequence[Key], num_shards: int, chunk_elems: int,
                 sparse: Iterable[int] = ()):
        self.specs = tuple(specs)
        self.keys = tuple(keys)
        self.num_shards = num_shards
        self.chunk_elems = chunk_elems
        self.sparse = frozenset(sparse)
        """Indices of the row-sparse parameters (2-D, keys on row boundaries)."""
        self._by_shard: list[list[Key]] = [[] for _ in range(num_shards)]
        self._by_param: list[list[Key]] = [[] for _ in self.specs]
        for key in self.keys:
            self._by_shard[key.shard].append(key)
            self._by_param[key.param].append(key)
        # Per key id, as a message's header carries them: checked on every message.
        self.key_shard = [k.shard for k in self.keys]
        self.key_dtype = [self.specs[k.param].dtype for k in self.keys]
        self.key_wire_shape = [[k.numel] for k in self.keys]
        self.key_nbytes = [k.numel * self.specs[k.param].itemsize for k in self.keys]

    def shard_keys(self, shard: int) -> list[Key]:
        """Keys held by shard, by id."""
        return list(self._by_shard[shard])

    def param_keys(self, param: int) -> list[Key]:
        """Keys of parameter specs[param], by offset."""
        return list(self._by_param[param])

    def row_dim(self, key: Key | int) -> int:
        """Elements per row of a row-sparse key's parameter; 0 for a dense key."""
        key = self.keys[key] if isinstance(key, int) else key
        return self.specs[key.param].shape[1] if key.param in self.sparse else 0

    def key_rows(self, key: Key | int) -> tuple[int, int]:
        """(first row, number of rows) of a row-sparse key in its parameter."""
        key = self.keys[key] if isinstance(key, int) else key
        dim = self.row_dim(key)
        if not dim:
            raise ValueError(f"key {key.id} is of dense parameter {self.specs[key.param].name!r}, not row-sparse")
        return key.offset // dim, key.numel // dim

    def dtype(self, key: Key | int) -> str:
        return self.specs[(self.keys[key] if isinstance(key, int) else key).param].dtype

    def nbytes(self, key: Key | int) -> int:
        return self.key_nbytes[key if isinstance(key, int) else key.id]

    def bytes_per_shard(self) -> list[int]:
        return [sum(self.nbytes(k) for k in keys) for keys in self._by_shard]

    def to_wire(self) -> dict[str, Any]:
        """A plain dict (str, int, list) that msgpack and json can carry."""
        return {
            "v": WIRE_VERSION,
            "num_shards": self.num_shards,
            "chunk_elems": self.chunk_elems,
            "params": [[s.name, list(s.shape), s.dtype] for s in self.specs],
            "keys": [[k.id, k.param, k.offset, k.numel, k.shard] for k in self.keys],
            "sparse": sorted(self.sparse),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> "Layout":
        """Rebuild and check a layout: ValueError naming the first thing that is wrong."""
        if not isinstance(wire, dict) or set(wire) != {"v", "num_shards", "chunk_elems", "params", "keys", "sparse"}:
            raise ValueError(f"layout must be a dict with fields v, num_shards, chunk_elems, params, keys, sparse; "
                             f"got {_short(wire)}")
        if wire["v"] != WIRE_VERSION:
            raise ValueError(f"layout version {wire['v']!r}, expected {WIRE_VERSION}")
        num_shards, chunk_elems = wire["num_shards"], wire["chunk_elems"]
        if not _is_int(num_shards) or num_shards < 1 or not _is_int(chunk_elems) or chunk_elems < 1:
            raise ValueError(f"layout num_shards and chunk_elems must be ints >= 1, got {num_shards!r}, {chunk_elems!r}")
        if not isinstance(wire["params"], list) or not isinstance(wire["keys"], list):
            raise ValueError("layout params and keys must be lists")
        specs = []
        for i, p in enumerate(wire["params"]):
            if not (isinstance(p, list) and len(p) == 3 and isinstance(p[1], list)):
                raise ValueError(f"layout param {i} must be [name, shape, dtype], got {_short(p)}")
            specs.append(ParamSpec(p[0], tuple(p[1]), p[2]))
        keys = []
        for i, k in enumerate(wire["keys"]):
            if not (isinstance(k, list) and len(k) == 5 and all(_is_int(x) and x >= 0 for x in k)):
                raise ValueError(f"layout key {i} must be [id, param, offset, numel, shard] ints >= 0, got {_short(k)}")
            key = Key(*k)
            if key.id != i or key.param >= len(specs) or key.shard >= num_shards:
                raise ValueError(f"layout key {i} = {k}: id must be {i}, param < {len(specs)}, shard < {num_shards}")
            keys.append(key)
        sparse = wire["sparse"]
        if not isinstance(sparse, list) or any(not _is_int(p) or not 0 <= p < len(specs) for p in sparse):
            raise ValueError(f"layout sparse must be a list of parameter indices < {len(specs)}, got {_short(sparse)}")
        for p in sparse:
            if len(specs[p].shape) != 2 or specs[p].shape[1] < 1:
                raise ValueError(f"layout: row-sparse parameter {specs[p].name!r} has shape {list(specs[p].shape)}; "
                                 "expected 2-D (rows, dim) with dim >= 1")
        layout = cls(specs, keys, num_shards, chunk_elems, sparse)
        for key in keys:
            dim = layout.row_dim(key)
            if dim and (key.offset % dim or key.numel % dim):
                raise ValueError(f"layout: key {key.id} of row-sparse parameter {specs[key.param].name!r} "
                                 f"does not hold whole rows of {dim}")
        for p, spec in enumerate(specs):  # every element of every parameter exactly once
            end = 0
            for key in layout.param_keys(p):
                if key.offset != end:
                    raise ValueError(f"layout: parameter {spec.name!r} key {key.id} starts at {key.offset}, expected {end}")
                end += key.numel
            if end != spec.numel or not layout.param_keys(p):
                raise ValueError(f"layout: keys of parameter {spec.name!r} cover {end} of {spec.numel} elements")
        return layout

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the canonical wire form: equal layouts, equal fingerprints."""
        text = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @cached_property
    def cut(self) -> str:
        """sha256 of how the parameters are cut and placed (each key's parameter, offset, size
        and shard, and the shard count), without names or dtypes: a run's record of its keys."""
        text = json.dumps([self.num_shards, [[k.param, k.offset, k.numel, k.shard] for k in self.keys]],
                          separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.fingerprint == other.fingerprint

    __hash__ = None  # mutable-looking; compare by fingerprint

    def __repr__(self) -> str:
        return f"Layout({len(self.specs)} params, {len(self.keys)} keys, {self.num_shards} shards)"


def _is_int(x: Any) -> bool:
    return type(x) is int


def _short(x: Any, n: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n] + "..."


def _chunk_sizes(numel: int, num_shards: int, chunk_elems: int, unit: int = 1, least: int = MIN_CHUNK_ELEMS) -> list[int]:
    """Near-equal chunk sizes for one flattened parameter, each a multiple of unit (a row),
    none cut to half of least elements or fewer."""
    if numel == 0:
        return [0]
    units, least = numel // unit, max(1, least // unit)
    chunk = max(1, chunk_elems // unit)
    size = max(1, min(chunk, max(math.ceil(units / num_shards), least)))
    n = math.ceil(units / size)
    rounded = math.ceil(n / num_shards) * num_shards  # every shard gets the same share of it
    if n > 1 and units // rounded >= min(least, chunk):
        n = rounded
    base, extra = divmod(units, n)
    return [(base + 1) * unit] * extra + [base * unit] * (n - extra)


def build_layout(specs: Iterable[ParamSpec], num_shards: int, chunk_elems: int,
                 sparse: Iterable[int] = (), sparse_chunk_elems: int | None = None) -> Layout:
    """Cut parameters into keys and assign them to shards.

    Args:
        specs: the parameters, in model order (key ids follow this order).
        num_shards: number of server shards (>= 1).
        chunk_elems: no key has more elements than this (>= 1). A parameter bigger than
            MIN_CHUNK_ELEMS is also cut into a multiple of num_shards near-equal pieces (as
            long as pieces stay >= MIN_CHUNK_ELEMS) so that it spreads evenly over all
            shards; smaller ones stay whole. Where a quarter of a shard's even share of all
            elements is below MIN_CHUNK_ELEMS (a small model, many shards), pieces go down to
            that quarter (no lower than MIN_SHARE_ELEMS), so that every shard holds near its share:
            mlp-mid with 256-wide layers (0.27 M elements) at most 1.06x the mean of 2 to 8
            shards (it was 1.23x at 2, 1.49x at 4, 1.95x at 8, where the predictor plays an
            even share).
        sparse: indices of row-sparse parameters (2-D): their keys hold whole rows.
        sparse_chunk_elems: no key of a row-sparse parameter has more elements than this
            (None: chunk_elems). Only the rows a batch touches travel, so its keys' size sets
            no message's size, while every key a message names costs its own frames.

    Chunks are then placed largest first (ties by key id) on the shard with the fewest bytes
    (ties by shard index), so max - min shard bytes <= the largest chunk. Deterministic.
    """
    specs = list(specs)
    if not _is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if not _is_int(chunk_elems) or chunk_elems < 1:
        raise ValueError(f"chunk_elems must be an int >= 1, got {chunk_elems!r}")
    sparse = frozenset(sparse)
    sparse_chunk_elems = chunk_elems if sparse_chunk_elems is None else sparse_chunk_elems
    if not _is_int(sparse_chunk_elems) or sparse_chunk_elems < 1:
        raise ValueError(f"sparse_chunk_elems must be an int >= 1, got {sparse_chunk_elems!r}")
    for p in sparse:
        if not 0 <= p < len(specs) or len(specs[p].shape) != 2 or specs[p].shape[1] < 1:
            raise ValueError(f"sparse parameter index {p}: expected a 2-D parameter (rows, dim) of the {len(specs)}")
    share = math.ceil(sum(spec.numel for spec in specs) / num_shards)
    least = max(MIN_SHARE_ELEMS, min(MIN_CHUNK_ELEMS, share // 4))
    pieces = []  # (param, offset, numel)
    for p, spec in enumerate(specs):
        offset = 0
        cut = (sparse_chunk_elems, spec.shape[1]) if p in sparse else (chunk_elems, 1)
        for size in _chunk_sizes(spec.numel, num_shards, *cut, least=least):
            pieces.append((p, offset, size))
            offset += size
    pieces = [(kid, *piece) for kid, piece in enumerate(_at_least(pieces, num_shards, specs, sparse))]
    heap = [(0, s) for s in range(num_shards)]  # (bytes, shard): least loaded first, ties by index
    shard_of = {}
    for kid, p, _, numel in sorted(pieces, key=lambda x: (-x[3] * specs[x[1]].itemsize, x[0])):
        load, shard = heapq.heappop(heap)
        shard_of[kid] = shard
        heapq.heappush(heap, (load + numel * specs[p].itemsize, shard))
    keys = [Key(kid, p, off, numel, shard_of[kid]) for kid, p, off, numel in pieces]
    return Layout(specs, keys, num_shards, chunk_elems, sparse)


def _at_least(pieces: list[tuple[int, int, int]], num_shards: int, specs: list[ParamSpec],
              sparse: frozenset) -> list[tuple[int, int, int]]:
    """pieces (param, offset, numel), the largest cut in two (on a row boundary where the
    parameter is row-sparse) until there are num_shards of them, so that every shard holds a
    key: a shard without one would count steps it takes no part in. ValueError where the
    model has fewer elements (rows) than shards."""
    def unit(piece: tuple[int, int, int]) -> int:
        return specs[piece[0]].shape[1] if piece[0] in sparse else 1

    pieces = list(pieces)
    while len(pieces) < num_shards:
        p, offset, numel = big = max(pieces, key=lambda piece: (piece[2] // unit(piece), -piece[0], -piece[1]))
        units = numel // unit(big)
        if units < 2:
            raise ValueError(f"{num_shards} shards for a model of {len(pieces)} pieces at most "
                             f"({sum(s.numel for s in specs)} elements): give it at most {len(pieces)} shards")
        half = units // 2 * unit(big)
        pieces[pieces.index(big)] = (p, offset, half)
        pieces.append((p, offset + half, numel - half))
    return sorted(pieces)


def split_values(layout: Layout, params: Sequence[torch.Tensor], shard: int | None = None) -> dict[int, torch.Tensor]:
    """Flat chunk views {key id: tensor} of params (in spec order), for one shard or all."""
    if len(params) != len(layout.specs):
        raise ValueError(f"got {len(params)} tensors for a layout of {len(layout.specs)} parameters")
    out = {}
    for key in layout.keys if shard is None else layout.shard_keys(shard):
        flat = params[key.param].detach().reshape(-1)
        out[key.id] = flat[key.offset:key.offset + key.numel]
    return out


def join_values(layout: Layout, values: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Parameters (in spec order, new tensors) assembled from the chunks of every key."""
    out = []
    for p, spec in enumerate(layout.specs):
        flat = torch.empty(spec.numel, dtype=TORCH_DTYPES[spec.dtype])
        for key in layout.param_keys(p):
            flat[key.offset:key.offset + key.numel] = values[key.id].reshape(-1)
        out.append(flat.reshape(spec.shape))
    return out
