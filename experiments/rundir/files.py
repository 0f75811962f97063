"""Files that several processes of a run share (on one host, or a directory shared by hosts).

Every such file is written whole or not at all: the bytes go to a temporary name in the same
directory, unique to this host and process, and a rename puts them in place, so a reader sees
the old file or the new one, never a half-written one. A reader of a file that another process
makes waits for it, for a bounded time, and then names the file and what it saw.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

READ_TIMEOUT_S = 30.0
"""How long a reader waits for a file another process has yet to write."""


def _tmp_name(path: Path) -> Path:
    # Unique across processes and hosts sharing the directory: host, pid and a random token.
    token = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    return path.with_name(f".{path.name}.{token}.tmp")


def write_with(path: Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) to make the file under a temporary name, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically."""
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
    return write_with(path, write)


def write_json(path: Path, data: Any, indent: int | None = 2) -> Path:
    """Write `data` as JSON to `path` atomically (keys sorted, newline at the end)."""
    return write_text(path, json.dumps(data, indent=indent, sort_keys=True) + "\n")


def save_torch(state: Any, path: Path) -> Path:
    """torch.save `state` to `path` atomically."""
    import torch

    return write_with(path, lambda tmp: torch.save(state, tmp))


def wait_for(path: Path, parse: Callable[[Path], T], timeout_s: float = READ_TIMEOUT_S,
             what: str = "file", poll_s: float = 0.05) -> T:
    """parse(path) once the file is there and parses; wait at most timeout_s for that.

    For a file that another process writes (another host's, over a shared directory, may
    appear late). Raises FileNotFoundError or ValueError naming the file and what was wrong.
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return parse(path)
        except FileNotFoundError:
            problem = None
        except (ValueError, EOFError, RuntimeError) as err:  # a writer that is not atomic
            problem = err
        if time.monotonic() >= deadline:
            waited = f" (waited {timeout_s:g} s)" if timeout_s > 0 else ""
            if problem is None:
                raise FileNotFoundError(f"{what} {path} does not exist{waited}")
            raise ValueError(f"{what} {path} is unreadable{waited}: {problem}")
        time.sleep(poll_s)


def read_json(path: Path, timeout_s: float = READ_TIMEOUT_S, what: str = "file") -> Any:
    """A JSON file another process writes, once it is there (see wait_for)."""
    return wait_for(path, lambda p: json.loads(p.read_text()), timeout_s, what)
