"""A shard's state as a whole: the checkpoint of everything it holds (values, optimizer
state, version, clocks) and its resume, and a script's optimizer state read ('state') and
replaced ('load', ps/protocol_state.py). A mixin of ps.shard.ShardServer, whose fields it
uses: shard, layout, chunks, optimizer, version, mode, num_workers, workers, counters,
snapshots, pulls, _dispatch, _ok."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ps.protocol import Message, encode
from ps.protocol_state import state_fields, states_of
from ps.shard.dispatch import Reply
from ps.shard.reject import Reject

log = logging.getLogger("psar.ps.server")


class ShardState:
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this shard: values, optimizer state, version, clocks."""
        return {"shard": self.shard, "fingerprint": self.layout.fingerprint, "version": self.version,
                "values": {k: t.detach().reshape(-1).clone() for k, t in self.chunks.items()},
                "optimizer": self.optimizer.state_dict(),
                "clocks": dict(self.workers.clocks), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); refuses a checkpoint of another shard or layout."""
        if state.get("shard") != self.shard or state.get("fingerprint") != self.layout.fingerprint:
            raise ValueError(f"checkpoint is of shard {state.get('shard')} with layout "
                             f"{str(state.get('fingerprint'))[:12]}, not shard {self.shard} with layout "
                             f"{self.layout.fingerprint[:12]}: same experiment, --set and --shard? (an older psar cut "
                             f"small models over several shards otherwise)")
        with torch.no_grad():
            for k, t in state["values"].items():
                self.snapshots.own(k)
                self.chunks[k].copy_(t.reshape(self.chunks[k].shape))
        self.optimizer.load_state_dict(state.get("optimizer") or {})
        self.version = int(state["version"])
        self.workers.clocks.update({int(w): int(c) for w, c in state["clocks"].items()})
        self.counters.update(state["counters"])
        self.snapshots.clear()
        if self.pulls is not None:
            self.pulls.reset()

    def _on_state(self, peer: bytes, msg: Message) -> list[Reply]:
        """The optimizer state of the keys asked for, as it is now (copies)."""
        try:
            fields, frames = state_fields([self.optimizer.slots(k) for k in msg.keys])
        except ValueError as e:
            raise Reject(str(e)) from None
        return [self._dispatch.send(peer, encode({"op": "ok", "worker": msg.worker, "req": msg.req,
                                                  "version": self.version, "keys": msg.keys, **fields}, frames))]

    def _on_load(self, peer: bytes, msg: Message) -> list[Reply]:
        """Replace the optimizer state of every key (a script's optimizer.load_state_dict):
        from worker 0 only; under async and ssp only with one worker, whose pushes cannot
        overtake it."""
        if msg.worker != 0:
            raise Reject(f"optimizer state is loaded by worker 0, not worker {msg.worker}")
        if self.mode != "sync" and self.num_workers > 1:
            raise Reject(f"optimizer state cannot be loaded under {self.mode} with {self.num_workers} workers: "
                         "the other workers' pushes may be applied before it")
        try:
            self.optimizer.load_slots(states_of(msg))
        except ValueError as e:
            raise Reject(str(e)) from None
        log.info("shard %d: optimizer state loaded by worker 0 at version %d", self.shard, self.version)
        return [self._ok(peer, msg)]

    def memory(self) -> dict[str, int]:
        """The bytes of what this shard holds, by kind: its parameters; the sync step's summed
        gradients at their most (async and ssp apply each push as it comes); its optimizer's
        state; the snapshots and spare buffers its replies are sent from."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

        return {"params": size(self.chunks.values()), "grads": getattr(self.rule, "most_summing", 0),
                "optimizer": size(t for state in self.optimizer.optimizer.state.values() for t in state.values()),
                "comm_buffers": self.snapshots.nbytes()}
