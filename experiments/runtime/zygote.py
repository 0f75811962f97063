"""One process that imports torch once and forks a run's processes from it.

Every worker and shard of a run otherwise imports torch itself (about 1.5 s of CPU each,
most of a short run's wall time on a small machine). The launcher starts this process first;
it imports what every process needs, runs no torch operation (so no thread pool exists yet
to be lost in a fork), and then forks one child per request:

    launcher -> zygote   {"argv": [python, "-m", MODULE | SCRIPT, ARGS...], "env": {...}, "cwd": DIR,
                          "netns": NAME or ""} with two file descriptors (the child's stdout and stderr)
    zygote -> launcher   {"pid": PID}, later {"exited": PID, "code": CODE}

The messages are JSON lines on a Unix socket pair, each checked before it is acted on;
nothing is pickled. A child runs its module or script as `python ARGV` would run it, with
the environment (PYTHONPATH too) and working directory it was given, and its exit code is what that run's would be (a negative
code: killed by that signal). The launcher signals and kills children by pid, as it would
its own. When the launcher goes, the zygote kills what it forked and leaves.

A command for an emulated host (`ip netns exec NAME python ...`) forks too: the child joins
the host's network namespace (setns) before it runs, so it binds and connects on the host's
link as the wrapped command would, without importing torch again (about 3 s of CPU on 2 busy
cores).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "numpy", "zmq", "msgpack")
"""What every process of a run imports and no process should import again (torch._dynamo:
the first optimizer a process builds imports it, about 1 s of CPU each)."""
MAX_MESSAGE = 1 << 20
READY_TIMEOUT_S = 120.0
"""How long the launcher waits for the zygote's imports (torch on a loaded machine)."""


NETNS_EXEC = ("ip", "netns", "exec")
NETNS_DIR = "/run/netns"


def unwrap(argv: list[str]) -> tuple[str, list[str]]:
    """(network namespace, command) of `ip netns exec NAME CMD...`; ("", argv) otherwise."""
    if tuple(argv[:3]) == NETNS_EXEC and len(argv) > 4:
        return argv[3], argv[4:]
    return "", argv


def can_fork(argv: list[str]) -> bool:
    """Whether argv is this interpreter running a module or a script, on this host or in a
    network namespace (`ip netns exec NAME` before it), and not some other command."""
    netns, argv = unwrap(argv)
    if netns and not _netns_path(netns):
        return False
    return len(argv) >= 2 and argv[0] == sys.executable and (
        (argv[1] == "-m" and len(argv) >= 3) or not argv[1].startswith("-"))


def _netns_path(name: str) -> str:
    """/run/netns/NAME for a plain name of an existing namespace, else ""."""
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        return ""
    path = os.path.join(NETNS_DIR, name)
    return path if os.path.exists(path) else ""


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (a just-forked process's one
    thread: the process; another thread: that thread alone, and whatever it starts)."""
    path = _netns_path(name)
    if not path:
        raise OSError(f"no network namespace {name!r} in {NETNS_DIR}")
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Zygote:
    """The launcher's side: start() it, fork() processes, poll() their exits."""

    def __init__(self, proc, sock: socket.socket) -> None:
        self._proc, self._sock = proc, sock
        self._buffer = b""
        self._lock = threading.RLock()
        self._ready = False
        self.codes: dict[int, int] = {}

    @classmethod
    def start(cls, env: dict[str, str] | None = None, wait: bool = True) -> "Zygote":
        """Start a zygote; wait: until its imports are done (else the first fork waits)."""
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen([sys.executable, "-u", "-m", "experiments.runtime.zygote", str(theirs.fileno())],
                                env=env, pass_fds=[theirs.fileno()])
        theirs.close()
        zygote = cls(proc, ours)
        if wait:
            zygote._await_ready()
        return zygote

    def _await_ready(self) -> None:
        if self._ready:
            return
        message = self._read(READY_TIMEOUT_S, "its imports")
        if message != {"ready": True}:
            self.close()
            raise RuntimeError(f"the zygote process answered {message!r} where it should be ready")
        self._ready = True

    def alive(self) -> bool:
        return self._proc.poll() is None and self._sock.fileno() != -1

    def fork(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int, cwd: str | None = None) -> int:
        """Start argv in a child with env and these stdout and stderr, in directory cwd (None:
        this process's); return its pid."""
        netns, argv = unwrap(list(argv))
        line = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd or os.getcwd(), "netns": netns}).encode() + b"\n"
        with self._lock:
            self._await_ready()
            socket.send_fds(self._sock, [line], [stdout, stderr])
            message = self._read(30.0, "a fork")
        if not isinstance(message, dict) or not isinstance(message.get("pid"), int):
            raise RuntimeError(f"the zygote process could not fork {argv[1:]}: {message!r}")
        return message["pid"]

    def poll(self) -> None:
        """Take in the exits the zygote has reported, without waiting."""
        with self._lock:
            while True:
                message = self._read(0.0, "exits", block=False)
                if message is None:
                    return
                self._take(message)

    def _take(self, message) -> None:
        if isinstance(message, dict) and isinstance(message.get("exited"), int) and isinstance(message.get("code"), int):
            self.codes[message["exited"]] = message["code"]
        else:
            raise RuntimeError(f"the zygote process sent {message!r}")

    def _read(self, timeout_s: float, what: str, block: bool = True):
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if not block:
                self._sock.setblocking(False)
            else:
                if left <= 0:
                    raise RuntimeError(f"the zygote process (pid {self._proc.pid}) did not answer within "
                                       f"{timeout_s:.0f} s while waiting for {what}")
                self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except (BlockingIOError, socket.timeout):
                if not block:
                    return None
                continue
            finally:
                self._sock.setblocking(True)
            if not chunk:
                raise RuntimeError(f"the zygote process (pid {self._proc.pid}) exited with code "
                                   f"{self._proc.wait()} while the launcher waited for {what}")
            self._buffer += chunk
            if len(self._buffer) > MAX_MESSAGE:
                raise RuntimeError("the zygote process sent a line over 1 MiB")
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if block and isinstance(message, dict) and "exited" in message:  # an exit came first: keep it
            self._take(message)
            return self._read(max(0.0, deadline - time.monotonic()), what, block)
        return message

    def close(self) -> None:
        """Let the zygote go (it kills any child still running) and wait for it."""
        self._sock.close()
        try:
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            self._proc.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared(env: dict[str, str] | None = None) -> Zygote:
    """This process's zygote, started now (with env) unless one is already running: every run
    this process launches forks from it. Started early, without waiting, its imports run
    beside the caller's."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            _shared = Zygote.start(env, wait=False)
            atexit.register(_shared.close)
        return _shared


class Forked:
    """A forked child as the launcher watches it: the parts of subprocess.Popen it uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.stdout = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.poll()
            self.returncode = self._zygote.codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the zygote process ---------------------------------------------------------------------

def _request(line: bytes, fds: list[int]) -> tuple[list[str], dict[str, str], str, str]:
    """(argv, env, cwd, netns) of a fork request, or ValueError naming what is wrong with it."""
    try:
        message = json.loads(line)
    except ValueError:
        raise ValueError(f"a fork request is not JSON: {line[:80]!r}") from None
    if not isinstance(message, dict) or set(message) != {"argv", "env", "cwd", "netns"}:
        raise ValueError(f"a fork request has the fields argv, env, cwd and netns, got {message!r}")
    argv, env, cwd, netns = message["argv"], message["env"], message["cwd"], message["netns"]
    if not (isinstance(netns, str) and (not netns or _netns_path(netns))):
        raise ValueError(f"netns {netns!r} is not a network namespace of this host")
    if not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise ValueError(f"cwd {cwd!r} is not a directory")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv) and can_fork(argv)):
        raise ValueError(f"argv {argv!r} is not this interpreter running a module or a script")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map names to strings")
    if len(fds) != 2:
        raise ValueError(f"a fork request carries 2 file descriptors, got {len(fds)}")
    return argv, env, cwd, netns


def _child(argv: list[str], env: dict[str, str], cwd: str, netns: str, stdout: int, stderr: int) -> None:
    """Become `python argv[1:]` (in network namespace netns) in this forked process; never returns."""
    code = 1
    try:
        if netns:
            enter_netns(netns)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout), os.close(stderr)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        # What python would have put on its path from this environment (PYTHONPATH, then the
        # zygote's own, which is this interpreter's site-packages and standard library).
        extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it stands, when the launcher asks
        if argv[1] == "-m":
            sys.path[0] = cwd
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket) -> None:
    """Fork a child per request until the launcher closes the socket; report their exits."""
    children: set[int] = set()

    def send(message: dict) -> None:
        sock.sendall(json.dumps(message).encode() + b"\n")

    buffer = b""
    fds: list[int] = []
    sock.settimeout(0.02)
    try:
        while True:
            while children:  # exits first: the launcher polls for them
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
            try:
                data, more, _, _ = socket.recv_fds(sock, 65536, 8)
            except socket.timeout:
                continue
            if not data:
                return
            buffer += data
            fds += more
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                mine, fds = fds[:2], fds[2:]
                try:
                    argv, env, cwd, netns = _request(line, mine)
                except ValueError as err:
                    for fd in mine:
                        os.close(fd)
                    send({"error": str(err)})
                    continue
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    _child(argv, env, cwd, netns, *mine)
                for fd in mine:
                    os.close(fd)
                children.add(pid)
                send({"pid": pid})
    finally:
        for pid in children:  # the launcher is gone: so is what it started
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    for module in PRELOAD:
        __import__(module)
    try:
        sock.sendall(b'{"ready": true}\n')
        serve(sock)
    except ConnectionError:  # the launcher has gone (serve has killed what it forked)
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
