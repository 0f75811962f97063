"""The calls a PSClient makes of every shard at once, blocking: counters, values, the
optimizer's state, leave and shutdown. A mixin of ps.client.PSClient, whose fields and
machinery it uses: addresses, _start, wait, _wait_replies, _need_layout, _hb_stop."""

from __future__ import annotations

from typing import Any

import torch

from ps.flight import PSError
from ps.protocol_state import state_fields, states_of


class WholeCalls:
    def stats(self) -> list[dict[str, Any]]:
        """Each shard's counters (blocking)."""
        h = self._start("stats", {s: ({"op": "stats"}, None) for s in range(len(self.addresses))})
        return [body for _, body in sorted(self.wait(h).bodies.items())]

    def checkpoint(self) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """({shard: version}, {key id: values}) snapshot of every shard (blocking)."""
        result = self.wait(self._start("checkpoint", {s: ({"op": "checkpoint"}, None) for s in range(len(self.addresses))}))
        return result.versions, result.values

    def optimizer_state(self) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """{key id: [(slot, tensor)]}: the optimizer state each shard keeps for its keys now,
        as ps/protocol_state.py carries it (blocking)."""
        layout = self._need_layout()
        h = self._start("state", {s: ({"op": "state", "keys": [k.id for k in layout.shard_keys(s)]}, None)
                                  for s in range(len(self.addresses))})
        self._wait_replies(h, h.timeout_s)
        out = {}
        for s, msg in sorted(h.replies.items()):
            if msg.get("slots") is None or msg.keys != [k.id for k in layout.shard_keys(s)]:
                raise PSError(f"{self.addresses[s]} (shard {s}) answered a state request without the state of its keys")
            out.update(states_of(msg))
        return out

    def load_optimizer_state(self, states: dict[int, list[tuple[str, torch.Tensor]]]) -> None:
        """Replace every shard's optimizer state by states {key id: [(slot, tensor)]}, every
        key's (blocking; worker 0)."""
        layout, per_shard = self._need_layout(), {}
        for s in range(len(self.addresses)):
            keys = [k.id for k in layout.shard_keys(s)]
            fields, frames = state_fields([states[k] for k in keys])
            per_shard[s] = ({"op": "load", "keys": keys, **fields}, frames)
        self.wait(self._start("load", per_shard))

    def leave(self) -> None:
        """Tell every shard this worker is done (blocking); it stops watching this worker and
        ends once all have left. Stops the heartbeats."""
        self._hb_stop.set()
        self.wait(self._start("leave", {s: ({"op": "leave"}, None) for s in range(len(self.addresses))}))

    def shutdown(self) -> None:
        """Ask every shard to stop serving (blocking)."""
        self.wait(self._start("shutdown", {s: ({"op": "shutdown"}, None) for s in range(len(self.addresses))}))
