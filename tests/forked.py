"""psar commands as a user starts them (`python -m experiments.cli ...`, or wrapped in `ip netns
exec HOST`), forked from one process of the session that has imported torch already
(experiments/runtime/zygote.py, as psar's launcher forks a run's processes).

Starting a fresh interpreter imports torch: about 2 s of CPU each on 2 cores, more than most
of what these tests then check, and tests that start a cluster by hand start four or five.
A forked child runs the command as the interpreter would (its module as __main__, its
arguments, environment and working directory, its exit code; killed by a signal: minus the
signal), so what the tests check of the command is unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from experiments.runtime import zygote

ROOT = Path(__file__).resolve().parents[1]


class Forked(zygote.Forked):
    """A forked command, with the parts of subprocess.Popen(text=True, stdout=PIPE,
    stderr=STDOUT) that the tests use: poll, wait, communicate, send_signal, kill."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, output: IO | None = None) -> None:
        """output: a file that takes its stdout and stderr (None: read, for communicate)."""
        self.args = argv
        z = zygote.shared()  # the launcher's too, for the runs the tests launch in this process
        self._out: list[bytes] = []
        self._reader: threading.Thread | None = None
        env = dict(os.environ if env is None else env)
        read, write = os.pipe() if output is None else (None, output.fileno())
        try:
            super().__init__(z, z.fork(argv, env, write, write, str(ROOT)))
        except BaseException:
            if read is not None:
                os.close(read)
            raise
        finally:
            if read is not None:
                os.close(write)  # the child has its own copy
        if read is not None:
            self._reader = threading.Thread(target=self._read, args=(read,), daemon=True)
            self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            while chunk := pipe.read1(1 << 16):
                self._out.append(chunk)

    def wait(self, timeout: float | None = None) -> int:
        try:
            return super().wait(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the command to end (subprocess.TimeoutExpired after timeout s) and its
        output to be read; its stdout and stderr together, as text."""
        start = time.monotonic()
        self.wait(timeout)
        left = None if timeout is None else max(1.0, timeout - (time.monotonic() - start))
        if self._reader is not None:
            self._reader.join(left)  # a child of the command may still hold the pipe: no longer
        return b"".join(self._out).decode(errors="replace"), None


def psar(*args, env: dict[str, str] | None = None, wrap: tuple[str, ...] = (), output: IO | None = None) -> Forked:
    """`python -m experiments.cli ARGS` (wrap: in front of the interpreter, e.g. `ip netns
    exec HOST`), run from the project's root; output: see Forked."""
    return Forked([*wrap, sys.executable, "-m", "experiments.cli", *map(str, args)], env, output)
