"""A shard's own time for a push+pull, in one process: `psar bench`'s guard on the per-message
path that a shard runs for every message, which the ZeroMQ tables see only behind the
transport's.

A shard of quickstart's model (4 keys of 8,192, 128, 1,280 and 10 float32, one message a step
from each of 2 workers, SGD with momentum, as quickstart trains) takes the push+pulls of STEPS
steps straight from handle(), the messages written beforehand: under each rule (sync, whose
first worker's pull waits for the second's push; async) with its compiled path
(ps.shard.compiled) and with Python's short path alone (ps.shard.fastpath), one after the other
in the same process so that their ratio is this moment's. Three runs on 2 cores: sync 13.0 to
17.6 us a message compiled against 66.4 to 71.6 through Python, async 6.0 to 6.4 against 88.0
to 93.9 (docs/results.md, "A sync step in the compiled path").
"""

from __future__ import annotations

import time

import torch

STEPS = 3000
"""Steps timed in each case (after WARMUP)."""
WARMUP = 20
"""Steps first, untimed: a key's first momentum step makes its buffer (Python's)."""
WORKERS = 2
SHAPES = ((128, 64), (128,), (10, 128), (10,))
"""quickstart's MLP 64-128-10."""


def time_rule(rule: str, compiled: bool, steps: int = STEPS) -> tuple[float, float]:
    """Seconds a push+pull through ShardServer.handle, the median of 5 runs of `steps` steps;
    and the share of the timed messages the compiled path took (0 without it)."""
    import statistics

    from ps.config import PSConfig
    from ps.layout import ParamSpec, build_layout, split_values
    from ps.protocol import encode, pack_header
    from ps.shard import ShardServer

    specs = [ParamSpec(f"p{i}", shape, "float32") for i, shape in enumerate(SHAPES)]
    layout = build_layout(specs, 1, 1 << 20)
    keys = [k.id for k in layout.shard_keys(0)]
    gen = torch.Generator().manual_seed(0)
    server = ShardServer(0, layout, split_values(layout, [torch.randn(s, generator=gen) for s in SHAPES], 0),
                         lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), rule, WORKERS, PSConfig())
    if not compiled:
        server._short.compiled = None
    for w in range(WORKERS):
        server.handle(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    peers = [f"w{w}".encode() for w in range(WORKERS)]
    # as a shard's transport hands a push over: two sets of gradient frames a worker (writable views),
    # written once (a sync step keeps its first push's frame until the step ends); each step's header
    # written beforehand, as PSClient.push writes it (ps.protocol.encode_whole)
    grads = [[[memoryview(bytearray((torch.randn(layout.keys[k].numel, generator=gen) * 1e-3).numpy().tobytes()))
               for k in keys] for _ in range(2)] for _ in range(WORKERS)]
    total = WARMUP + 5 * steps
    whole = {"dtypes": [layout.key_dtype[k] for k in keys], "shapes": [layout.key_wire_shape[k] for k in keys]}

    def header(w: int, step: int) -> bytes:
        return pack_header({"op": "push", "worker": w, "req": step + 1, "step": step,
                            "version": step if rule == "sync" else 0, "keys": keys, "pull": 1,
                            **({"min_version": step + 1} if rule == "sync" else {"clock": step + 1}), **whole})

    messages = [[[header(w, step)] + grads[w][step % 2] for w in range(WORKERS)] for step in range(total)]
    times = []
    first = taken = 0
    for run in range(6):
        if run == 1:
            taken = server._short.compiled.taken if server._short.compiled is not None else 0
        n = WARMUP if run == 0 else steps
        start = time.perf_counter()
        for step in range(first, first + n):
            for w in range(WORKERS):
                # the replies let go at once, as the transport sends them: a key a reply still
                # pointed at would move to a copy before its next update
                server.handle(peers[w], messages[step][w])
        first += n
        if run:
            times.append((time.perf_counter() - start) / (n * WORKERS))
    if server.counters["rejected"] or server.counters["malformed"]:
        raise RuntimeError(f"psar bench: the shard refused the loop's messages ({server.counters})")
    if server._short.compiled is not None:
        taken = server._short.compiled.taken - taken
    return statistics.median(times), taken / (5 * steps * WORKERS)


def shard_loop(steps: int = STEPS) -> list[dict]:
    """Per rule, us a push+pull with the compiled path and with Python's short path alone, their
    ratio (compiled over Python) and the share of the messages the compiled path took: rows
    {"rule", "compiled_us", "python_us", "ratio", "compiled_share"}. compiled_us, ratio and
    compiled_share are None where the compiled path is not built."""
    from ps.shard.compiled import available

    rows = []
    for rule in ("sync", "async"):
        python, _ = time_rule(rule, False, steps)
        fast, share = time_rule(rule, True, steps) if available() else (None, None)
        rows.append({"rule": rule, "compiled_us": None if fast is None else fast * 1e6, "python_us": python * 1e6,
                     "ratio": None if fast is None else fast / python, "compiled_share": share})
    return rows


def format_shard_loop(rows: list[dict]) -> str:
    lines = [f"a shard's push+pull in one process, no transport (quickstart's 4 keys, {WORKERS} workers, "
             "SGD with momentum; median of 5 runs of its steps): us a message"]
    for r in rows:
        fast = "not built" if r["compiled_us"] is None else f"{r['compiled_us']:.1f}"
        ratio = "" if r["ratio"] is None else f" ({r['ratio']:.2f}x; {r['compiled_share']:.0%} of them compiled)"
        lines.append(f"  {r['rule']:6s} compiled {fast}, Python's short path {r['python_us']:.1f}{ratio}")
    return "\n".join(lines)
