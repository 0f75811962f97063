"""Worker side: ps-lite's Push / Pull / Wait over one DEALER per server shard.

push and pull send at once to every shard involved and return a Handle; wait(handle) takes
replies from any shard as they come (matching them by request id), so pushes and pulls to
different shards are in flight together. A PSClient is used from one thread; its heartbeat
thread has its own sockets.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from typing import Any, Sequence

import torch

from ps.client_compiled import SendFailed, lane_for
from ps.client_heartbeat import Heartbeats
from ps.client_replies import Replies
from ps.client_whole import WholeCalls
from ps.client_window import PushWindow
from ps.codec import Codec, Packed
from ps.flight import Handle, PSError, Result
from ps.config import WIRE_DTYPES
from ps.layout import TORCH_DTYPES, Layout
from ps.protocol import Limits, Message, encode, encode_whole
from ps.protocol_checks import rows_in_order
from ps.protocol_short import WholeKeys
from ps.security import load_client_keys
from ps.transport import ClientTransport, PeerTimeout, PollSet

__all__ = ["PSClient", "PSError", "PeerTimeout", "Handle", "Result"]


class PSClient(Replies, PushWindow, Heartbeats, WholeCalls):
    """Client of worker `worker` towards the server shards at `addresses` (shard order).

    Args:
        addresses: one endpoint per shard, e.g. ["tcp://127.0.0.1:5555", ...].
        worker: this worker's id, 0..num_workers-1.
        timeout_s: longest wait for any reply (default 60). A pull that waits on a condition
            gets a little longer, so that the server's own deadline error arrives first.
        heartbeat_s: heartbeat interval once joined (default 1).
        context: zmq context; share the server's for inproc:// (default: the process-wide one).
        max_message_mb: inbound message parts above this are refused (default 1024).
        curve_dir: key directory (ps.security.make_keys) to speak CurveZMQ to the shards, as
            client `curve_name`; "" (default): no security, for servers without curve_dir.
        curve_name: which client keypair of curve_dir to use (default "worker").
        compression: "none", "fp16" or "bf16": pushes leave cast to that dtype, and pulls may
            come in it (ps.compression; the shards must have the same).
        window_mb: most bytes of push+pull messages a shard may hold unanswered from this
            client (ps.window_mb); later ones wait here until replies come. 0 (default): none.
        compressor: compress.method's compressor (experiments.compression, by shape): pushes
            may carry ps.codec.Packed messages, and sync pull replies the compressed gradient
            of their update (checked against it once the layout is known). None: neither.
    """

    def __init__(self, addresses: Sequence[str], worker: int, timeout_s: float = 60.0, heartbeat_s: float = 1.0,
                 context: Any = None, max_message_mb: float = 1024.0, curve_dir: str = "",
                 curve_name: str = "worker", compression: str = "none", window_mb: float = 0.0,
                 compressor: Any = None):
        if not addresses:
            raise ValueError("PSClient needs at least one server address")
        self.addresses, self.worker = list(addresses), worker
        self.timeout_s, self.heartbeat_s, self._context = timeout_s, heartbeat_s, context
        if compression not in WIRE_DTYPES:
            raise ValueError(f"compression {compression!r}: expected one of {', '.join(WIRE_DTYPES)}")
        self._wire = WIRE_DTYPES[compression]
        self._curve = load_client_keys(curve_dir, curve_name) if curve_dir else None
        self._max_bytes = int(max_message_mb * (1 << 20))
        self._limits = Limits(max_header_bytes=self._max_bytes, max_keys=1 << 22, max_map_len=1 << 16,
                              max_tensor_bytes=self._max_bytes)
        self._transports = [self._transport(a) for a in self.addresses]
        self._pollset = PollSet(self._transports)
        self._inflight: dict[int, Handle] = {}
        self._window = int(window_mb * (1 << 20))
        # shard -> heap of (priority, req, frames, bytes) the window holds: the lowest priority
        # leaves first, then the earliest request
        self._held: dict[int, list] = defaultdict(list)
        self._unanswered: dict[int, int] = defaultdict(int)  # shard -> bytes of push+pulls it has not answered
        self._counted: dict[int, tuple[int, int]] = {}  # req -> (shard, bytes), push+pulls in the window
        self._reqs = itertools.count(1)
        self.layout: Layout | None = None
        self._whole: list[WholeKeys] = []  # per shard, its whole keys (ps.protocol_short), once joined
        self._lane = None  # the compiled lane (ps.client_compiled), once joined
        self._compressor = compressor
        self.codec: Codec | None = None  # once joined
        self.codec_s = 0.0  # seconds spent decompressing pulled gradients
        self.versions: dict[int, int] = {}
        self.clocks: dict[int, int] = {}  # shard -> this worker's clock there, as of join
        self.bytes_sent = self.bytes_recv = 0
        self.heartbeat_error: str | None = None
        self.last_heard: dict[int, float] = {}  # shard -> when it last answered a heartbeat
        self.forgotten: set[int] = set()  # shards that no longer know this worker (restarted)
        self.settings: dict[str, Any] | None = None  # sent with every join
        self.joins = 0  # completed joins; heartbeats carry it, so answers from before a rejoin are told apart
        self._joins_lock = threading.Lock()  # a join and the heartbeat thread's verdict on a reply
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_tick = 0.0  # when the heartbeat thread last woke

    def _transport(self, address: str, send_timeout_s: float | None = None) -> ClientTransport:
        return ClientTransport(address, self._max_bytes, send_timeout_s or self.timeout_s, self._context,
                               curve=self._curve)

    # -- ps-lite calls -------------------------------------------------------------------------

    def init(self, layout: Layout, values: dict[int, torch.Tensor], optim: dict[str, Any]) -> None:
        """Worker 0 of a run whose shards were started without a model (a user's script): give
        every shard the layout, its keys' initial values and the optimizer settings it runs
        ({name: scalar}). Blocks (at most timeout_s)."""
        wire = layout.to_wire()
        per_shard = {}
        for s in range(layout.num_shards):
            keys = [k.id for k in layout.shard_keys(s)]
            per_shard[s] = ({"op": "init", "body": {"layout": wire, "optim": dict(optim)}, "keys": keys},
                            [values[k].detach().cpu().contiguous().reshape(-1) for k in keys])
        self.wait(self._start("init", per_shard))

    def join(self, settings: dict[str, Any] | None = None,
             rejoin: bool = False) -> tuple[Layout, int, dict[int, torch.Tensor]]:
        """Register with every shard: (layout, smallest version, {key id: initial values}).
        settings: this worker's {name: scalar} run settings, which the shards compare with
        theirs (a mismatch is a PSError naming each). rejoin: this process takes the place of
        a worker of the same id that was lost or died; a sync shard answers once it counts it
        in again (at its next step). Blocks (at most timeout_s); starts the heartbeat thread."""
        if settings is not None:
            self.settings = dict(settings)  # kept for a rejoin
        header = {"op": "join", **({"settings": self.settings} if self.settings is not None else {}),
                  **({"rejoin": 1} if rejoin else {})}
        h = self._start("join", {s: (header, None) for s in range(len(self.addresses))})
        self._wait_replies(h, self.timeout_s)
        layouts, body_of = {}, {}
        for s, msg in h.replies.items():
            body = body_of[s] = msg.get("body") or {}
            if body.get("shard") != s:
                raise PSError(f"{self.addresses[s]} says it is shard {body.get('shard')!r}, expected shard {s}")
            try:
                layouts[s] = Layout.from_wire(body.get("layout"))
            except ValueError as e:
                raise PSError(f"{self.addresses[s]} sent an invalid layout: {e}") from e
        layout = layouts[0]
        for s, other in layouts.items():
            if other != layout:
                raise PSError(f"{self.addresses[s]} (shard {s}) has layout {other.fingerprint[:12]}, "
                              f"shard 0 has {layout.fingerprint[:12]}: servers disagree on the layout")
        if layout.num_shards != len(self.addresses):
            raise PSError(f"layout has {layout.num_shards} shards but {len(self.addresses)} addresses were given")
        self.layout = layout
        self._whole = [WholeKeys(layout, [k.id for k in layout.shard_keys(s)], self._limits)
                       for s in range(layout.num_shards)]
        if self._compressor is not None:
            self.codec = Codec(self._compressor, layout)
        if self._lane is not None:
            self._lane.close()
        self._lane = lane_for(self)
        values = {}
        for s, msg in h.replies.items():
            expected = [k.id for k in layout.shard_keys(s)]
            if msg.keys != expected:
                raise PSError(f"{self.addresses[s]} sent values for keys {msg.keys[:8]}..., expected its keys {expected[:8]}...")
            for k, t in zip(msg.keys, msg.tensors):
                if t.dtype != TORCH_DTYPES[layout.dtype(k)] or t.shape != layout.keys[k].shape:
                    raise PSError(f"{self.addresses[s]} sent key {k} as {t.dtype} {tuple(t.shape)}, "
                                  f"the layout says {layout.dtype(k)} {layout.keys[k].shape}")
                values[k] = t
            self.versions[s] = msg.get("version")
            self.clocks[s] = body_of[s].get("clock", 0)
        with self._joins_lock:
            self.joins += 1
            self.forgotten.clear()
        self._start_heartbeat()
        return layout, min(self.versions.values()), values

    def push(self, step: int, version: int | None, grads: dict[int, Any], pull: bool = False,
             next_version: bool = False, clock: int | None = None, lr: float | None = None,
             hold: bool = False, priority: int | None = None) -> Handle:
        """Send gradients {key id: chunk, or (row ids, rows) for rows of a row-sparse key, or
        a ps.codec.Packed compressed chunk (then every key of the push is)} computed for
        `step` on parameters of `version` (None: the version last received from each shard).
        Row ids count from the key's first row, strictly increasing (int64); rows are (n, dim).
        Non-blocking; the tensors must not change until wait(handle) returns (they leave
        without a copy). wait's Result has the largest staleness the shards report.

        pull: ask in the same message for the pushed keys' values, as pull(keys,
        next_version=next_version, clock=clock) would right behind the push: one message
        each way instead of two. wait's Result then holds that pull's values too. Whole keys only (no rows).

        lr: the learning rate the shards update these keys with (None: their optimizer's own).
        hold: (sync) the shards keep the step's averaged gradient until a pull brings the clip
        scale (see norm).

        priority: of the push+pulls a shard's window holds back (window_mb), the one of the
        lowest priority leaves first (ties, and None, in the order of the calls): give every
        push+pull one, or none."""
        layout = self._need_layout()
        if (next_version or clock is not None) and not pull:
            raise ValueError("next_version and clock are conditions of the values push(pull=True) asks for")
        # the compiled lane: a message the window would send at once (or that it never holds)
        if self._lane is not None and not (pull and self._window and not self._window_open(grads)):
            try:
                sent = self._lane.push(grads, step, version, pull, lr, hold, next_version, clock, self.timeout_s)
            except SendFailed as e:
                shard, err, before, sizes = e.args  # the messages to the shards before it left
                self.bytes_sent += before
                if pull and self._window:  # in flight: counted, as the Python path counts each it sent
                    self._count_sent({req: self._inflight[req].pending[req] for req in sizes}, sizes)
                raise self._transports[shard].send_failed(err) from None
            if sent is not None:
                handle, nbytes, sizes = sent
                self.bytes_sent += nbytes
                if pull and self._window:
                    self._count_sent(handle.pending, sizes)
                return handle
        by_shard: dict[int, tuple[list[int], list[torch.Tensor], list]] = {}
        n_keys, wire = len(layout.keys), TORCH_DTYPES[self._wire] if self._wire else None
        key_shard, key_dtype, keys_of = layout.key_shard, layout.key_dtype, layout.keys
        n_packed = n_rows = 0
        for k, g in grads.items():
            if not (type(k) is int and 0 <= k < n_keys):
                raise ValueError(f"push: key {k!r} is not in the layout (keys 0..{n_keys - 1})")
            shard = key_shard[k]
            entry = by_shard.get(shard)
            if entry is None:
                entry = by_shard[shard] = ([], [], [])
            keys, tensors, row_ids = entry
            keys.append(k)
            ids = None
            if type(g) is not torch.Tensor:
                if isinstance(g, Packed):
                    n_packed += 1
                    tensors.append(g)
                    continue
                if isinstance(g, tuple):
                    if pull:
                        raise ValueError("push(pull=True) takes whole keys only; pull rows with pull(rows=...)")
                    n_rows += 1
                    ids, g = self._row_ids(k, g[0]), g[1]
            if g.requires_grad:
                g = g.detach()
            if not g.is_cpu:
                g = g.cpu()
            dim = layout.row_dim(k) if ids is not None else 0
            numel = keys_of[k].numel if ids is None else ids.numel() * dim
            if g.numel() != numel or g.dtype != TORCH_DTYPES[key_dtype[k]]:
                raise ValueError(f"push: key {k} needs {numel} {key_dtype[k]} values, got {g.numel()} {g.dtype}")
            row_ids.append(ids)
            # Compressed: the cast is the copy that leaves; otherwise the tensor leaves as it is.
            if wire is not None:
                g = g.to(wire)
            if not g.is_contiguous():
                g = g.contiguous()
            if ids is not None:
                g = g.reshape(ids.numel(), dim)
            elif g.dim() != 1:
                g = g.reshape(-1)
            tensors.append(g)
        if n_packed and not (n_packed == len(grads) and self.codec is not None):
            raise ValueError("push: compressed (Packed) keys need a client with a compressor, and "
                             "every key of the push compressed")
        per_shard = {}
        for s, (keys, tensors, row_ids) in by_shard.items():
            v = version if version is not None else self.versions.get(s, 0)
            at = step if step is not None else self.versions.get(s, 0)  # sync: the shard's own step
            header = {"op": "push", "step": at, "version": v, "keys": keys}
            if lr is not None:
                header["lr"] = float(lr)
            if hold:
                header["hold"] = 1
            if pull:
                header["pull"] = 1
                if next_version:
                    header["min_version"] = self.versions.get(s, 0) + 1
                if clock is not None:
                    header["clock"] = clock
            if n_packed:
                per_shard[s] = (header, None, None, [(p.frames, p.meta) for p in tensors])
            elif n_rows or wire is not None:  # rows only in the messages of shards that hold pushed rows
                per_shard[s] = (header, tensors, row_ids if any(i is not None for i in row_ids) else None)
            else:  # whole keys as the layout has them: its dtypes and shapes
                header["dtypes"] = [key_dtype[k] for k in keys]
                header["shapes"] = [layout.key_wire_shape[k] for k in keys]
                per_shard[s] = (header, tensors)
        return self._start("push+pull" if pull else "push", per_shard, conditional=next_version or clock is not None,
                           priority=priority)

    def _row_ids(self, k: int, ids: torch.Tensor) -> torch.Tensor:
        """ids as the wire wants them: int64 on the CPU, checked against key k's rows."""
        layout = self._need_layout()
        if not layout.row_dim(k):
            raise ValueError(f"key {k} is of a dense parameter; it cannot be sent by rows")
        ids = ids.detach().to("cpu", torch.int64).reshape(-1).contiguous()
        rows = layout.key_rows(k)[1]
        if not rows_in_order(ids, rows):
            raise ValueError(f"key {k}: row ids must be strictly increasing within 0..{rows - 1}")
        return ids

    def pull(self, keys: Sequence[int] | None = None, min_version: int | dict[int, int] | None = None,
             clock: int | None = None, wait_left: bool = False, next_version: bool = False,
             rows: dict[int, torch.Tensor] | None = None, scale: float | None = None) -> Handle:
        """Ask for the current values of keys (default all). The server answers once its
        version >= min_version (sync; a dict gives one per shard), under ssp once clock is within the staleness bound
        of the slowest worker, and with wait_left once every other worker has left.
        next_version: each shard answers once past the version this client last saw from it
        (sync steps, counted per shard). rows: {key: row ids} asks for only those rows of
        those row-sparse keys (ids as in push); they are pulled besides keys. Non-blocking;
        wait gives its Result. scale: the clip coefficient of a held sync step (see norm),
        with which each shard first makes that step's update."""
        layout = self._need_layout()
        rows = {k: self._row_ids(k, i) for k, i in (rows or {}).items()}
        if keys is not None and set(keys) & set(rows):
            raise ValueError(f"pull: keys {sorted(set(keys) & set(rows))} asked for whole and by rows")
        by_shard: dict[int, list[int]] = defaultdict(list)
        for k in [*(range(len(layout.keys)) if keys is None and not rows else keys or ()), *rows]:
            if not (type(k) is int and 0 <= k < len(layout.keys)):
                raise ValueError(f"pull: key {k!r} is not in the layout (keys 0..{len(layout.keys) - 1})")
            by_shard[layout.keys[k].shard].append(k)
        per_shard_min = min_version if isinstance(min_version, dict) else None
        cond = {n: v for n, v in (("min_version", None if per_shard_min else min_version), ("clock", clock),
                                  ("wait_left", 1 if wait_left else None),
                                  ("scale", None if scale is None else float(scale))) if v is not None}
        def condition(s: int) -> dict:
            if next_version:
                return {**cond, "min_version": self.versions.get(s, 0) + 1}
            return {**cond, "min_version": per_shard_min[s]} if per_shard_min and s in per_shard_min else cond

        def ids(ks: list[int]) -> list | None:
            return [rows.get(k) for k in ks] if any(k in rows for k in ks) else None

        return self._start("pull", {s: ({"op": "pull", "keys": ks, **condition(s)}, None, ids(ks))
                                    for s, ks in by_shard.items()},
                           conditional=bool(cond) or next_version or bool(per_shard_min))

    def step_done(self) -> Handle:
        """Ask every shard to answer, without values, once it has finished the sync step past
        the version this client last saw from it (every key updated). Non-blocking; wait's
        Result has each shard's version and the longest time a shard held the answer back."""
        self._need_layout()
        return self._start("wait", {s: ({"op": "wait", "min_version": self.versions.get(s, 0) + 1}, None)
                                    for s in range(len(self.addresses))}, conditional=True)

    def norm(self) -> Handle:
        """Ask every shard for the sum of squares of its averaged gradient of the held sync
        step this client last pushed (answered once every worker's pushes are in). Non-blocking;
        wait's Result has them as sq {shard: sum of squares}."""
        self._need_layout()
        return self._start("norm", {s: ({"op": "norm", "step": self.versions.get(s, 0)}, None)
                                    for s in range(len(self.addresses))}, conditional=True)

    def wait(self, handle: Handle, timeout_s: float | None = None) -> Result:
        """Block until every shard of handle has answered; what they answered, as a Result.
        Raises PSError on an error reply, PeerTimeout naming the silent shard's address (the
        handle then stays pending: waiting again is allowed)."""
        self._wait_replies(handle, timeout_s if timeout_s is not None else handle.timeout_s)
        result = Result(handle.kind)
        versions, waited_us = result.versions, 0
        for s, m in handle.replies.items():
            h = m.header
            if h.get("version") is not None:
                versions[s] = h["version"]
            if m.parts:
                self._decompress(s, m, result.grads)
            else:
                result.values.update(zip(m.keys, m.tensors))
            if m.ids:
                result.ids.update((k, i) for k, i in zip(m.keys, m.ids) if i is not None)
            waited_us = max(waited_us, h.get("waited_us") or 0)
            if h.get("staleness") is not None:
                result.staleness = max(result.staleness, h["staleness"])
            if h.get("sq") is not None:
                result.sq[s] = h["sq"]
            if h.get("body") is not None:
                result.bodies[s] = h["body"]
        result.version = min(versions.values(), default=0)
        result.waited_s = waited_us / 1e6
        if handle.kind in ("pull", "push+pull"):
            self.versions.update(versions)
        return result

    def _decompress(self, s: int, m: Message, grads: dict[int, torch.Tensor]) -> None:
        """A compressed reply's gradients into grads (the codec's time counted)."""
        start = time.perf_counter()
        for k, p, meta in zip(m.keys, m.parts, m.get("meta") or ()):
            try:
                grads[k] = self.codec.decompress(k, p, meta)
            except ValueError as e:
                raise PSError(f"{self.addresses[s]} (shard {s}) sent key {k} compressed wrongly: {e}") from e
        self.codec_s += time.perf_counter() - start

    def wait_alive(self, handle: Handle) -> Result:
        """wait() for as long as the shards keep answering heartbeats: for requests whose
        reply legitimately takes long (a final pull waiting for slower workers to finish)."""
        while True:
            try:
                return self.wait(handle, self.timeout_s)
            except PeerTimeout:
                now = time.monotonic()
                silent = [s for s in sorted(set(handle.pending.values()))
                          if now - self.last_heard.get(s, 0.0) > self.timeout_s]
                if silent or self._hb_thread is None:
                    raise

    def ready(self, handle: Handle) -> bool:
        """Take whatever replies have arrived, without blocking; True once handle is done."""
        self._progress(0.0, drain=True)
        return handle.done

    def close(self) -> None:
        """Stop heartbeats and close the sockets; pending handles are abandoned."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=max(1.0, 2 * self.heartbeat_s))
        if self._lane is not None:  # its sockets close now
            self._lane.close()
            self._lane = None
        for t in self._transports:
            t.close()
        self._transports = []

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- machinery -----------------------------------------------------------------------------

    def _need_layout(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("call join() before push or pull: the client has no layout yet")
        return self.layout

    def _start(self, kind: str, per_shard: dict[int, tuple], conditional: bool = False,
               priority: int | None = None) -> Handle:
        """Send per_shard {shard: (header, tensors or None[, row ids per key or None[, compressed
        parts]])}; push+pulls the window holds leave by priority (see push)."""
        h = Handle(kind, timeout_s=self.timeout_s + (min(self.timeout_s, 5.0) if conditional else 0.0))
        for s, (header, tensors, *ids) in per_shard.items():
            req = next(self._reqs)
            header["worker"], header["req"] = self.worker, req  # each header is built for this call
            frames = encode(header, tensors, ids[0] if ids else None, ids[1] if len(ids) > 1 else None) \
                if ids or header["op"] != "push" else encode_whole(header, tensors)  # push's (header, tensors): whole keys
            nbytes = sum(map(len, frames))  # bytes, or byte views (ps.protocol.encode)
            if kind == "push+pull":
                self._push_pull(s, req, frames, nbytes, priority)
            else:
                self._send(s, req, frames, nbytes)
            h.pending[req] = s
            h.keep.append((tensors, ids))
            self._inflight[req] = h
        return h

