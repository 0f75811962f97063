"""A well-formed request that a shard cannot serve now."""

from __future__ import annotations


class Reject(Exception):
    """Becomes an error reply naming the shard, with `code` (ps.protocol.ERROR_CODES) where a
    client acts on the kind."""

    def __init__(self, text: str, code: str | None = None) -> None:
        super().__init__(text)
        self.code = code
