"""Which rank is gone? Every rank stamps the time into the rendezvous store; when a collective
fails, the ranks whose stamps stop advancing are the ones that were lost.

A collective only says that a connection broke; this turns that into "rank 1 is gone".
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch.distributed as dist

KEY = "psar/alive/{}"


class LostRank(RuntimeError):
    """A collective failed because a peer is gone; the message names it."""


class Liveness:
    def __init__(self, rank: int, world: int, interval_s: float = 0.5) -> None:
        self.rank, self.world, self.interval_s = rank, world, interval_s
        self._stop = threading.Event()
        self._store = None
        self._thread = None
        try:
            # A connection of our own: the process group's is busy with its own traffic.
            self._store = dist.distributed_c10d._get_default_store().clone()
            self._store_timeout_s = max(2.0, 4 * interval_s)
            self._store.set_timeout(timedelta(seconds=self._store_timeout_s))
        except Exception:  # no store to stamp (a launcher without one): plain errors then
            return
        self._stamp()
        self._thread = threading.Thread(target=self._run, name="psar-liveness", daemon=True)
        self._thread.start()

    def _stamp(self) -> None:
        self._store.set(KEY.format(self.rank), repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._stamp()
            except Exception:  # the store's host is gone; explain() will say so
                return

    def _stamps(self) -> dict[int, str]:
        keys = [KEY.format(r) for r in range(self.world)]
        present = [r for r, key in enumerate(keys) if self._store.check([key])]
        return {r: self._store.get(keys[r]).decode() for r in present}

    def explain(self, error: BaseException) -> str:
        """A message naming the lost rank(s), waited for over a few stamp intervals."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if self._store is None:
            return f"a peer was lost ({first})"
        try:
            before = self._stamps()
            time.sleep(4 * self.interval_s)
            after = self._stamps()
        except Exception:
            return (f"rank 0 is gone: the rendezvous store it hosts no longer answers "
                    f"(the collective failed with: {first})")
        lost = [r for r in range(self.world) if r != self.rank and before.get(r) == after.get(r)]
        if not lost:
            return f"the collective failed but every rank is still alive: {first}"
        names = ", ".join(f"rank {r}" for r in lost)
        return f"{names} {'is' if len(lost) == 1 else 'are'} gone (no sign of life for " \
               f"{4 * self.interval_s:.1f} s); the collective failed with: {first}"

    @contextlib.contextmanager
    def naming_lost_ranks(self):
        """Turn a failed collective into an error that names the rank that was lost."""
        try:
            yield
        except (RuntimeError, dist.DistError) as err:
            raise LostRank(self.explain(err)) from err

    def stop_stamping(self) -> None:
        """Stop the stamping thread, while the store is still up: call it before leaving the
        process group, whose end on rank 0 takes the store down; a stamp caught inside a store
        call then would hold this rank for the store's whole timeout, while its peers go on."""
        self._stop.set()
        if self._thread is not None:
            # Long enough for a stamp blocked on a store that is gone to time out.
            self._thread.join(timeout=self._store_timeout_s + self.interval_s + 1)
            self._thread = None

    def close(self) -> None:
        """Stop stamping and let go of the store connection now, while the interpreter is
        whole: a thread still inside a store call, or a store torn down, at interpreter exit
        can abort the process ("terminate called without an active exception")."""
        self.stop_stamping()
        self._store = None
