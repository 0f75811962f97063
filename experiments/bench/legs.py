"""Where a push+pull's time goes, leg by leg, next to a ZeroMQ round trip of the same bytes:
to the server (the worker's call to the server's receive), the server's own (its receive to
its send), and back (its send to the worker's result), each timed at both ends on the host's
monotonic clock, which every process of the host reads alike. One worker against `psar
bench`'s shard, which notes its own marks (ps.benchmark.TimedTransport). A push+pull adds to
the round trip what its legs add to the echo's: the worker's Python before its bytes leave
and after they come back, and the shard's decode, update and reply. `bash .ci/device tables`
prints it on the lent machine; docs/results.md has figures.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from experiments.bench import bench_server, size_label

LEG_SIZES = (1 << 10, 1 << 20, 4 << 20)
ITERS = 160
"""Round trips and push+pulls timed at each size, after WARMUP of each."""
WARMUP = 40
LEGS = ("to", "server", "back", "total")


def push_pull_legs(out: Path, sizes: tuple[int, ...] = LEG_SIZES, iters: int = ITERS,
                   warmup: int = WARMUP) -> list[dict]:
    """One row per size: the median of each leg over `iters` echoes and push+pulls, taken in
    turns after `warmup` of each (see legs_rows), from a shard in its own process given half
    the host, as psar bench's one-at-a-time table gives it."""
    out.mkdir(parents=True, exist_ok=True)
    marks_path = out / "ps-legs-marks.json"
    marks_path.unlink(missing_ok=True)
    with bench_server(out / "ps-legs-server.log", str(marks_path), str(min(sizes))) as (echo, shard):
        times = _drive(echo, shard, sizes, warmup + iters)
    if not marks_path.exists():  # it did not stop (and was killed), or failed
        raise RuntimeError(f"the legs' shard wrote no marks; see {out / 'ps-legs-server.log'}")
    return legs_rows(times, json.loads(marks_path.read_text()), sizes, warmup)


def _drive(echo_addr: str, ps_addr: str, sizes: tuple[int, ...], n: int) -> list[tuple[int, int, int, int]]:
    """n echoes and n push+pulls of each size in turns; per pair the worker's marks (ns): before
    the echo's send, after its receive (and before the push), after push() returned, after wait."""
    import torch

    from ps.benchmark import CONFIG, SIZES, one_worker

    times, step = [], 0
    with one_worker(echo_addr, ps_addr) as (echo, ps, layout):
        for nbytes in sizes:
            key = layout.param_keys(SIZES.index(nbytes))[0].id
            payload = torch.ones(nbytes // 4)
            frames = [b"x", memoryview(payload.numpy()).cast("B")]
            for _ in range(n):
                a = time.monotonic_ns()
                echo.send(frames)
                echo.recv(CONFIG.timeout_s, "the echo")
                b = time.monotonic_ns()
                handle = ps.push(step, None, {key: payload}, pull=True)
                c = time.monotonic_ns()
                ps.wait(handle)
                times.append((a, b, c, time.monotonic_ns()))
                step += 1
    return times


def _pairs(marks: list, what: str) -> list[tuple[int, int, int, int | None]]:
    """(received, sent, keys moved so far, its thread's CPU ns so far or None) of each message
    a socket answered; sends before the first receive (the join's reply) are not answers."""
    while marks and marks[0][0] == "s":
        marks = marks[1:]
    if len(marks) % 2 or any(m[0] != k for m, k in zip(marks, "rs" * (len(marks) // 2))):
        raise ValueError(f"the shard's {what} marks do not alternate receive and send")
    return [(marks[i][1], marks[i + 1][1], marks[i + 1][2], marks[i + 1][3] if len(marks[i + 1]) > 3 else None)
            for i in range(0, len(marks), 2)]


def legs_rows(times: list[tuple[int, int, int, int]], marks: dict, sizes: tuple[int, ...], warmup: int) -> list[dict]:
    """Rows of the table from the worker's marks (_drive's) and the shard's ({"echo": [...],
    "ps": [...]}, [kind, ns] each): per size the median, over the pairs after `warmup`, of
    each leg of the echo (zmq_to_us, zmq_server_us, zmq_back_us, zmq_total_us) and of the
    push+pull (ps_...), and of the worker's push() call (push_call_us); ps_thread_us: the
    shard's thread's CPU from one push+pull's send to the next one's (its poll, receive, work
    and send; where the marks hold it); moved: the share of the push+pulls whose update first
    moved the key, because the reply before still pointed at it
    (ps.shard.snapshots.SnapshotPool.own)."""
    echo, ps = _pairs(marks["echo"], "echo's"), _pairs(marks["ps"], "push+pulls'")
    if not len(echo) == len(ps) == len(times) or len(times) % len(sizes):
        raise ValueError(f"{len(times)} pairs timed by the worker, {len(echo)} echoes and {len(ps)} push+pulls "
                         f"by the shard: they must be as many, and {len(sizes)} sizes' worth")
    n, rows = len(times) // len(sizes), []
    for i, nbytes in enumerate(sizes):
        legs: dict[str, list[float]] = {}
        moved = 0
        for j in range(i * n + warmup, (i + 1) * n):
            (a, b, c, d), (er, es, _, _), (pr, ps_sent, count, cpu) = times[j], echo[j], ps[j]
            moved += count > (ps[j - 1][2] if j else 0)
            if cpu is not None and j > i * n:  # the previous send is this size's too
                legs.setdefault("ps_thread", []).append((cpu - ps[j - 1][3]) / 1e3)
            for name, value in (("zmq_to", er - a), ("zmq_server", es - er), ("zmq_back", b - es), ("zmq_total", b - a),
                                ("ps_to", pr - b), ("ps_server", ps_sent - pr), ("ps_back", d - ps_sent),
                                ("ps_total", d - b), ("push_call", c - b)):
                legs.setdefault(name, []).append(value / 1e3)
        if not legs:
            raise ValueError(f"no pairs after the {warmup} of warm-up at {nbytes} bytes")
        rows.append({"bytes": nbytes, "pairs": n - warmup, "moved": moved / (n - warmup),
                     **{f"{k}_us": statistics.median(v) for k, v in legs.items()}})
    return rows


def format_legs_table(rows: list[dict]) -> str:
    lines = [f"where a push+pull's time goes, against a ZeroMQ round trip of the same bytes (one worker, one shard; "
             f"medians of {rows[0]['pairs'] if rows else 0}, us): to the server (the worker's call to the server's "
             f"receive), the server's (its receive to its send), back (its send to the worker's result); "
             f"thread: the shard's thread's CPU from one push+pull's send to the next; "
             f"moved: the push+pulls whose update first copied the key, its reply before not yet sent",
             f"{'size':>10} {'zmq to':>8} {'server':>7} {'back':>7} {'total':>7}   {'ps to':>7} {'server':>7} "
             f"{'back':>7} {'total':>7} {'push()':>7} {'thread':>7} {'moved':>6}"]
    for r in rows:
        thread = f"{r['ps_thread_us']:>7.0f}" if "ps_thread_us" in r else f"{'':>7}"
        lines.append(f"{size_label(r['bytes']):>10} " + " ".join(f"{r[f'zmq_{k}_us']:>{8 if k == 'to' else 7}.0f}" for k in LEGS)
                     + "   " + " ".join(f"{r[f'ps_{k}_us']:>7.0f}" for k in LEGS) + f" {r['push_call_us']:>7.0f}"
                     + f" {thread} {r['moved']:>5.0%}")
    return "\n".join(lines)
