"""Configuration of the parameter server: one small frozen dataclass, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass

WORKER_LOSS_POLICIES = ("mode", "drop", "abort")
WIRE_DTYPES = {"none": None, "fp16": "float16", "bf16": "bfloat16"}
"""ps.compression: the dtype pushes and pulls travel in (the shards keep their own)."""
ASYNC_SCALES = ("mean", "sum")
EXCHANGES = ("pipelined", "phased")
ORDERS = ("forward", "arrival")
SPARSE_MODES = ("auto", "rows", "dense")


KEY_MS = 5.0
"""chunk_mb=0 on a link of known rate: keys of about what the link carries in this long."""
KEY_MB_RANGE = (0.125, 4.0)
"""... rounded to a power of two within this range; 4 MiB, BytePS's partition, where the rate
is unknown. mlp-mid with 4 workers and 4 shards of their own, median step (alternated with
the 4-worker ring in one run): at 1gbit 0.27 to 0.29 s with 0.5 MiB keys (5 ms), 0.45 to 0.46
s with 2 MiB (20 ms; the ring 0.36 to 0.41 s); at 200mbit 1.15 to 1.18 s with 0.125 MiB keys,
1.19 to 1.20 s with 0.5 MiB (the ring 1.58 to 1.63 s). Smaller keys pay off once a message's
fixed cost is small: a shard fills and drains its pipeline one key from every worker at a time.
On loopback mlp-wide with 2 workers and one shard took 0.26 to 0.27 s with 4 MiB keys, 0.295 s
with 0.5 MiB."""


def key_mb(chunk_mb: float, rate_bits: float | None = None) -> float:
    """The key size in MiB that chunk_mb means on links of rate_bits bit/s (None: unknown)."""
    if chunk_mb:
        return chunk_mb
    low, high = KEY_MB_RANGE
    if not rate_bits:
        return high
    mb = rate_bits / 8 * KEY_MS / 1000 / (1 << 20)
    return min(high, max(low, 2.0 ** round(math.log2(mb))))


WINDOW_MS = 20.0
"""ps.order=forward on links of known rate: a sync worker's window towards a shard holds at
most what the link carries in this long (ps.window_mb at most), and its buckets a quarter of
that, so that the messages behind it wait on the worker, where the first layers' keys can
pass the others; a window of 3 MiB leaves them in the sockets, in the order backward made
them. mlp-mid on 4 workers with 4 shards of their own, 10 steps, median step over the
4-worker ring's, 3 alternated rounds: at 200mbit 0.70 (ps.order=arrival 0.73; forward with
the 3 MiB window 0.72 in another run), at 1gbit 0.74 (arrival 0.76; forward with a 0.5 MiB
window 0.87 in another run). gpt-char on 2 workers at 200mbit: 87 to 89 ms a step, arrival
114 to 116 ms."""

WINDOW_KEYS = 4
"""... and at least this many keys: a shard answers a key only once every worker has pushed
it, so a window of one or two keys makes a worker wait out each key's round trip before it
sends the next (stop and wait). At 100mbit 20 ms is 1.9 keys of 1/8 MiB: mlp-mid on 4
workers with 4 shards of their own took 4.07 s a step (arrival's 3 MiB window 2.53 s, the
ring 3.09 s); at 200mbit and 1gbit 20 ms is about 4 keys."""


def forward_window(window_mb: float, bucket_kb: float, rate_bits: float | None,
                   key: float = 0.0) -> tuple[float, float]:
    """(window_mb, bucket_kb) of a ps.order=forward sync worker on links of rate_bits bit/s
    (None: unknown, then as given; a window of 0 stays none) with keys of `key` MiB."""
    if not rate_bits or not window_mb:
        return window_mb, bucket_kb
    window = min(window_mb, max(rate_bits / 8 * WINDOW_MS / 1000 / (1 << 20), WINDOW_KEYS * key))
    return window, min(bucket_kb, window * 1024 / 4)


def sync_window(window_mb: float, bucket_kb: float, key: float, rate_bits: float | None = None,
                order: str = "forward") -> tuple[float, float]:
    """(window_mb, bucket_kb) a ps-sync worker runs with, its keys of `key` MiB: forward_window's
    under ps.order=forward on links of known rate, and in every case at least WINDOW_KEYS keys
    (a window of 0 stays none). A window under two keys is stop and wait: with 4 MiB keys (the
    key where the rate is unknown, or from about 7 Gbit/s) and the 3 MiB default, mlp-wide x2 on
    loopback took 289 and 295 samples/s, with 16 MiB 324 and 346, with none 350 and 319."""
    if not window_mb:
        return window_mb, bucket_kb
    if rate_bits and order == "forward":
        window_mb, bucket_kb = forward_window(window_mb, bucket_kb, rate_bits, key)
    return max(window_mb, WINDOW_KEYS * key), bucket_kb


@dataclass(frozen=True)
class PSConfig:
    """Settings shared by the parameter-server shards and their clients."""

    staleness: int = 2
    """ps-ssp bound s: a worker may run at most s clocks ahead of the slowest live worker."""

    chunk_mb: float = 0.0
    """Tensors larger than this many MiB are split into chunks (keys) spread over the shards;
    0: by the link (see key_mb). A key is the unit of pipelining: a shard answers it once
    every worker has pushed it, while later keys still arrive, so both directions of its link
    are busy; the wait for a shard's first key, and the replies after its last, each cost a
    key from every worker, and every message costs the shard and the worker their fixed
    per-message work (0.1 to 0.2 ms here)."""

    timeout_s: float = 60.0
    """Longest single wait on a peer (a reply, a deferred pull) before it is an error."""

    heartbeat_s: float = 1.0
    """Interval between a client's heartbeats to each shard."""

    worker_timeout_s: float = 30.0
    """A worker not heard from for this long is lost."""

    on_worker_loss: str = "mode"
    """What a shard does when a worker is lost: "drop" it (the others go on), "abort" the run,
    or "mode": drop under async and ssp, which have no barrier to hold, abort under sync,
    whose steps would otherwise quietly average fewer workers."""

    async_scale: str = "mean"
    """Async/ssp pushes: "mean" scales each by 1/N (a round of N pushes moves as far as one
    sync step), "sum" applies it as is."""

    max_message_mb: float = 1024.0
    """Largest inbound message part in MiB; the socket refuses bigger ones (ZMQ_MAXMSGSIZE)."""

    reconnect_s: float = 0.0
    """How long a worker waits for a shard that stopped answering to come back (restarted with
    --resume) before it gives up; 0: give up at once."""

    curve_dir: str = ""
    """Key directory of ps.security.make_keys: CurveZMQ authentication and encryption on every
    tcp connection (servers need server.key_secret and allowed/, workers server.key and their
    <name>.key_secret). "": none, for loopback and trusted networks only."""

    curve_name: str = "worker"
    """Which client keypair of curve_dir a worker uses (one per worker lets one be revoked)."""

    compression: str = "none"
    """Pushes and pulls cast to "fp16" or "bf16" on the wire (half the bytes); the shards keep
    their master values and optimizer state in the parameters' own dtype. "none": as they are."""

    bucket_kb: float = 512.0
    """Gradients leave in one message per shard once they hold this many KiB (or backward is
    done): small parameters together, as DDP's buckets, and a large one's keys as soon as
    each fills it (a message never waits for the rest of its parameter); 0: each parameter's
    keys as soon as backward produces them."""

    window_mb: float = 3.0
    """ps-sync's pipelined exchange: most MiB of a worker's push messages one shard may hold
    unanswered; later ones wait on the worker until replies come. A shard answers a key only
    once every worker has pushed it, so this keeps a worker whose flow runs ahead from taking
    the shard's link from those behind. It holds at least 4 of the worker's keys (sync_window). 0: no window. (1 MiB starved 4 workers on one shard:
    7.7 s a step where none gave 4.8 s and 3 MiB 4.5 s.)"""

    exchange: str = "pipelined"
    """How a sync worker gets the step's new values back. "pipelined": each push asks for its
    keys' next values, which a shard sends as soon as every worker has pushed them, so the
    values of early buckets come back while later ones are still being pushed: the fastest
    where shards have links of their own. "phased": the worker pulls only once every shard
    has finished the step, so no reply shares a link with a push: for shards co-located with
    the workers, where a shard's replies to a host would otherwise slow the pushes to that
    host's own shard, which then answers last, alone on its link. Costs one round trip."""

    order: str = "forward"
    """ps-sync's pipelined exchange, the order of a step's values (P3, ByteScheduler).
    "forward": the push+pulls a shard's window holds back leave first-layer keys first, and
    the next forward loads each layer's values as it reaches that layer, so it starts once
    the first layer's are in (a user's script gets them all in step()); on links of known
    rate (net.rate) the window and buckets shrink to what the link carries in 20 ms (the
    window at least four keys), so that the messages wait where they can be reordered.
    "arrival": they leave as backward made them (last layer first) and step() waits for
    every value. The parameters are the same bit for bit."""

    sparse: str = "auto"
    """Embedding tables: "rows" pushes the rows a batch touched (ids and summed rows) and
    pulls the rows the next batch looks up, and the shards update only those; "dense" moves
    whole tables; "auto": rows when the optimizer's update of an untouched row is no update
    (sgd without momentum or weight decay, adagrad without weight decay), else dense."""

    push_every: int = 1
    """Downpour SGD's n_push: a worker pushes the sum of its gradients every K steps (1:
    every step). Between fetches it steps its own optimizer (the experiment's) on each step's
    gradient, as Downpour's replicas do."""

    fetch_every: int = 1
    """Downpour SGD's n_fetch: a worker fetches the shards' values every K steps, replacing
    its own (1: every step). Under ps-sync it must equal push_every (a round: K local steps,
    one push of their sum, the step's new values)."""

    backup_workers: int = 0
    """ps-sync with backup workers (Chen et al. 2016; TensorFlow's SyncReplicasOptimizer with
    replicas_to_aggregate = N - b): each key of a step is updated with the mean of the first
    N - b live workers' pushes of it; later pushes of that step are dropped and counted, and
    their worker takes the new values and goes on at the shards' step. 0: every live worker."""

    easgd_alpha: float = 0.1
    """ps-easgd: the moving rate alpha in (0, 1) by which a worker's model and the centre move
    towards each other at each exchange (the paper's beta = N * alpha; 0.9 / N is its choice)."""

    easgd_tau: int = 4
    """ps-easgd: steps between a worker's exchanges with the centre (the paper's tau)."""

    def __post_init__(self) -> None:
        if isinstance(self.easgd_alpha, bool) or not isinstance(self.easgd_alpha, (int, float)) \
                or not 0 < self.easgd_alpha < 1:
            raise ValueError(f"ps.easgd_alpha={self.easgd_alpha!r}: must be in (0, 1)")
        if type(self.easgd_tau) is not int or self.easgd_tau < 1:
            raise ValueError(f"ps.easgd_tau={self.easgd_tau!r}: must be an int >= 1")
        if type(self.backup_workers) is not int or self.backup_workers < 0:
            raise ValueError(f"ps.backup_workers={self.backup_workers!r}: must be an int >= 0 (0: none)")
        for name in ("push_every", "fetch_every"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ps.{name}={value!r}: must be an int >= 1 (1: every step)")
        for name in ("bucket_kb", "window_mb", "chunk_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.sparse not in SPARSE_MODES:
            raise ValueError(f"sparse must be one of {SPARSE_MODES}, got {self.sparse!r}")
        if type(self.staleness) is not int or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if not (isinstance(self.reconnect_s, (int, float)) and 0 <= self.reconnect_s < math.inf):
            raise ValueError(f"reconnect_s must be a finite number >= 0, got {self.reconnect_s!r}")
        for name in ("timeout_s", "heartbeat_s", "worker_timeout_s", "max_message_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.on_worker_loss not in WORKER_LOSS_POLICIES:
            raise ValueError(f"on_worker_loss must be one of {WORKER_LOSS_POLICIES}, got {self.on_worker_loss!r}")
        if self.compression not in WIRE_DTYPES:
            raise ValueError(f"compression must be one of {tuple(WIRE_DTYPES)}, got {self.compression!r}")
        if self.async_scale not in ASYNC_SCALES:
            raise ValueError(f"async_scale must be one of {ASYNC_SCALES}, got {self.async_scale!r}")
        if not isinstance(self.curve_dir, str):
            raise ValueError(f"curve_dir must be a str (a key directory, or \"\" for none), got {self.curve_dir!r}")
        if self.heartbeat_s >= self.worker_timeout_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be smaller than worker_timeout_s "
                f"({self.worker_timeout_s}), or live workers would be declared lost")

    @property
    def downpour(self) -> bool:
        """Whether workers step on their own between pushes or fetches (push_every or
        fetch_every above 1)."""
        return self.push_every > 1 or self.fetch_every > 1

    def check_downpour(self, engine: str, sync: bool, compression: str = "none") -> None:
        """Downpour's settings against the engine's (`sync`: one averaged update a round) and
        compress.method's: ValueError naming what does not go together."""
        if not self.downpour:
            return
        if sync and self.push_every != self.fetch_every:
            raise ValueError(f"ps.push_every={self.push_every} and ps.fetch_every={self.fetch_every} under "
                             f"{engine}: a sync round pushes, then takes the step's values; they must be equal")
        if compression != "none":
            raise ValueError(f"ps.push_every/ps.fetch_every above 1 with compress.method={compression}: "
                             "one at a time")

    def loss_policy(self, mode: str) -> str:
        """on_worker_loss as it applies to a shard in `mode` ("sync", "async" or "ssp")."""
        if self.on_worker_loss != "mode":
            return self.on_worker_loss
        return "abort" if mode == "sync" else "drop"

    @property
    def wire_dtype(self) -> str | None:
        """The dtype name pushes and pulls travel in, None when uncompressed."""
        return WIRE_DTYPES[self.compression]

    @property
    def max_message_bytes(self) -> int:
        """max_message_mb in bytes, as the socket option wants it."""
        return int(self.max_message_mb * (1 << 20))
