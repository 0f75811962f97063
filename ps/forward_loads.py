"""ps.order=forward on the worker side (P3): a sync step leaves its push+pulls' values to the
next forward, whose pre-hook on each module takes the values of that module's parameters as
soon as their replies are in, so the first layer runs while the last layers' still travel.

What taking them learns (the forward's wait, staleness, the shards' hold-ups) and the bytes
still coming are handed to the next step()'s record, so that a step's record keeps its own
traffic and its forward's wait counts as communication, not compute.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

from .config import WIRE_DTYPES
from .layout import ITEMSIZE, Layout


def nothing_late() -> dict:
    """What taking no deferred values learns: no staleness, no hold-up, no wait."""
    return {"staleness": [], "wait_s": 0.0, "forward_s": 0.0}


class ForwardLoads:
    """The values a step left to the next forward. load(values) copies {key: values} into
    the parameters (the engine's _load); trace as the engine's."""

    def __init__(self, client: Any, layout: Layout, compression: str, load: Callable[[dict], None],
                 trace: Callable | None) -> None:
        self.client, self.layout, self.load, self.trace = client, layout, load, trace
        self._wire = WIRE_DTYPES[compression]
        self._carries: dict[int, list[int]] = {}  # id of a push+pull handle -> its keys
        self._awaiting: dict[int, list] = {}  # parameter index -> [name, sent at, handle, taken] entries
        self.clear()

    def clear(self) -> None:
        """Forget everything in flight (the client abandoned it)."""
        self._carries.clear()
        self._awaiting = {}
        self._late = nothing_late()
        self._coming = 0

    def hooks(self, model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]]) -> list:
        """A forward pre-hook on each module that owns parameters, and a state_dict pre-hook on
        the model (a checkpoint reads the values); their handles."""
        index = {id(p): i for i, (_, p) in enumerate(named)}
        out = []
        for module in model.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if own:
                out.append(module.register_forward_pre_hook(functools.partial(self._before, own)))
        out.append(model.register_state_dict_pre_hook(lambda *_: self.settle(counted=False)))
        return out

    def carry(self, handle: Any, keys: list[int]) -> None:
        """handle, a push+pull of this step, brings the values of keys."""
        self._carries[id(handle)] = list(keys)

    def defer(self, pushes: list[tuple[str, float, Any]]) -> set[int]:
        """Leave the push+pulls of pushes [(name, sent at, handle)] that carry values to the
        forward; the ids of their handles."""
        deferred = set()
        for name, sent_at, handle in pushes:
            keys = self._carries.pop(id(handle), None)
            if keys is None:
                continue
            self._coming += sum(self.layout.keys[k].numel * ITEMSIZE[self._wire or self.layout.key_dtype[k]]
                                for k in keys)
            entry = [name, sent_at, handle, False]
            for param in {self.layout.keys[k].param for k in keys}:
                self._awaiting.setdefault(param, []).append(entry)
            deferred.add(id(handle))
        self._carries.clear()
        return deferred

    def _before(self, indexes: list[int], _module, _args) -> None:
        """Forward pre-hook of a module whose parameters are `indexes`: their values first."""
        for i in indexes:
            for entry in self._awaiting.pop(i, ()):
                self._take(entry)

    def _take(self, entry: list, counted: bool = True) -> None:
        """Wait for one deferred push+pull and load its values (counted: the wait is the
        step's communication, not compute)."""
        name, sent_at, handle, taken = entry
        if taken:
            return
        entry[3] = True
        start = time.perf_counter()
        result = self.client.wait(handle)
        if counted:
            self._late["forward_s"] += time.perf_counter() - start
        self.load(result.values)
        self._late["staleness"].append(result.staleness)
        self._late["wait_s"] = max(self._late["wait_s"], result.waited_s)
        if self.trace is not None:
            self.trace(f"push+pull {name}", sent_at, handle.done_at, thread="push", waited_on_server_s=result.waited_s)

    def settle(self, counted: bool = True) -> None:
        """Take every value left to the forward: the parameters then hold the shards' values."""
        awaiting, self._awaiting = self._awaiting, {}
        for entries in awaiting.values():
            for entry in entries:
                self._take(entry, counted)

    def handed_over(self) -> tuple[dict, int]:
        """({"staleness", "wait_s", "forward_s"} learnt since the last call, bytes of the values
        still coming), for step()'s record; both start again."""
        late, coming = self._late, self._coming
        self._late, self._coming = nothing_late(), 0
        return late, coming
