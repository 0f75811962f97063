"""Leaving a process group safely after collectives that were started inside backward.

For the length of each backward, torch (2.13) keeps a Python object (the caller's contextvars
context) in its thread-local state (`_engine_run_backward` in torch/autograd/graph.py). Every
collective started inside backward (the buckets' all-reduces, started from gradient hooks)
captures that state, and the backend's worker thread lets go of it when it drops the finished
work, which takes the GIL. The process group's destructor joins those worker threads while it
holds the GIL. If it runs before a worker has dropped its last work (a worker thread not
scheduled for a while, on a loaded machine), each waits for the other forever. That was seen as
a rank held after a ddp job, in the destructor of DDP's reducer, while its peer's next
rendezvous timed out.

So each backward notes that object, and the shutdown waits, with the GIL released, until no
work holds one any more.
"""

from __future__ import annotations

import sys
import time

import torch

KEY = "context"
"""The key under which torch keeps the object during backward."""


SUPPORTED = all(hasattr(torch._C, name) for name in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls"))
"""Whether this torch keeps an object there during backward and takes it out after (2.11
keeps none: there is nothing to wait for)."""


def held_elsewhere(objs: list) -> list[bool]:
    """For each of objs, whether anything besides the list refers to it. The count is
    compared with a fresh object's held alike, so the interpreter's own references cancel."""
    probe = [object()]
    base = sys.getrefcount(probe[0])
    return [sys.getrefcount(objs[i]) > base for i in range(len(objs))]


class BackwardStates:
    """Notes the thread-local object of each backward; `wait_released` waits until the
    collectives that captured one have all been let go of, for at most timeout_s."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._held: list = []

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), noting the state its collectives capture."""
        if SUPPORTED and loss.requires_grad:
            loss.register_hook(self._note)  # the first node backward runs, inside its state
        loss.backward()

    def _note(self, grad: torch.Tensor) -> None:
        if torch._C._is_key_in_tls(KEY):
            still = held_elsewhere(self._held)
            self._held = [obj for obj, held in zip(self._held, still) if held]
            self._held.append(torch._C._get_obj_in_tls(KEY))

    def wait_released(self, who: str) -> None:
        """Until no collective holds a noted object (each is let go of on a worker thread that
        needs the GIL, so this sleeps meanwhile). Raises RuntimeError after timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while any(held_elsewhere(self._held)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{who}: the process group's worker threads still hold collectives of the "
                    f"last backward after {self.timeout_s:.0f} s; leaving the group now could deadlock")
            time.sleep(0.001)
        self._held = []
