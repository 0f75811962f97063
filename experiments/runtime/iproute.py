"""iproute2 for the emulated cluster (experiments/runtime/netns.py): commands with a timeout
and their errors named, whether this machine can make shaped namespaces at all, and the
clean-up of what a killed run left (namespaces named psar-PID-..., whose PID is gone)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

CMD_TIMEOUT_S = 20
PREFIX = "psar-"


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be made; the message has the command and its error."""


class CongestionRefused(NetworkError):
    """A host's namespace takes none of the TCP congestion controls asked for."""


def run(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Run an iproute2 command (input: its standard input); a failure raises NetworkError with
    the command and stderr."""
    cmd = tuple(map(str, cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, input=input)
    except subprocess.TimeoutExpired:
        raise NetworkError(f"`{' '.join(cmd)}` did not end within {CMD_TIMEOUT_S} s") from None
    except FileNotFoundError:
        raise NetworkError(f"`{cmd[0]}` is not installed (iproute2)") from None
    if check and res.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


CONGESTION = "/proc/sys/net/ipv4/tcp_congestion_control"
"""Where a namespace's TCP congestion control is read and set."""


def congestion(netns: str, name: str = "") -> str:
    """TCP's congestion control in namespace netns, set first where `name` is given: one name,
    or several in order of preference ("cubic,reno": the first this machine lets a namespace
    use). A new namespace starts with the machine's default and takes only what the machine
    allows (net.ipv4.tcp_allowed_congestion_control); NetworkError naming those where it takes
    none of `name` (CongestionRefused). Returns what the namespace runs."""
    if name:
        names = name.split(",")
        for one in names:
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", one):  # it goes through sh
                raise NetworkError(f"net.congestion={name!r}: {one!r} is not a TCP congestion control's name")
        for one in names:
            res = run("ip", "netns", "exec", netns, "sh", "-c", f"echo {one} > {CONGESTION}", check=False)
            if res.returncode == 0:
                break
        else:
            allowed = run("ip", "netns", "exec", netns, "cat", CONGESTION.replace("congestion_control",
                                                                                 "allowed_congestion_control"),
                          check=False).stdout.split()
            raise CongestionRefused(f"net.congestion={name}: a host's namespace takes only what this machine "
                                    f"allows ({', '.join(allowed) or 'none'}; "
                                    f"net.ipv4.tcp_allowed_congestion_control): {res.stderr.strip()}")
    return run("ip", "netns", "exec", netns, "cat", CONGESTION).stdout.strip()


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here, in one line, or None if they can."""
    if not os.uname().sysname == "Linux":
        return f"emulated networks need Linux network namespaces, this is {os.uname().sysname}"
    if os.geteuid() != 0:
        return "emulated networks need root (network namespaces, veths and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated networks need iproute2's `{tool}`, which is not on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        run("tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit",
            "burst", "32kb", "latency", "50ms")
    except NetworkError as err:
        return f"cannot build a shaped link here: {err}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc (latency); tbf and htb are enough for rate."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        return run("tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    except NetworkError:
        return False
    finally:
        run("ip", "netns", "del", probe, check=False)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines()
            if line.split()]


def clean_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a run killed before it could clean
    up); returns their names. Live runs' namespaces are left alone."""
    removed = []
    for name in _namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if not m or _alive(int(m.group(1))):
            continue
        _kill_inside(name)
        if run("ip", "netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str, attempts: int = 50) -> list[int]:
    """SIGKILL every process in netns (only ones a run started there); the pids that stayed."""
    pids: list[int] = []
    for _ in range(attempts):
        pids = [int(p) for p in run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return pids
