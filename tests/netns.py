"""Several "hosts" on one Linux machine: network namespaces joined by veth links to a bridge.

Every namespace is new and private to the caller (names carry the pid), including the one
that holds the bridge, so nothing in the root namespace changes, and the hosts' subnet exists
only inside these namespaces: traffic between them never leaves them. Needs root and
iproute2's `ip`; `unavailable()` says why it cannot be used here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

IP = shutil.which("ip") or "ip"
CMD_TIMEOUT_S = 20


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; a failure raises NetnsError with the command and its stderr."""
    cmd = [IP, *map(str, args)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not end within {CMD_TIMEOUT_S} s") from None
    if check and res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def unavailable() -> str | None:
    """Why namespaces with veth links and a bridge cannot be built here, or None if they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    probe = f"psar-{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except NetnsError as err:
        return f"`ip netns add` does not work here: {err}"
    try:
        ip("-n", probe, "link", "add", "br0", "type", "bridge")
        ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except NetnsError as err:
        return f"cannot create a bridge and a veth pair in a namespace: {err}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    netns: str
    """The namespace's name (`ip netns exec NETNS ...`)."""
    addr: str
    """Its IPv4 address on the private subnet."""
    ifname: str
    """Its interface on that subnet (the veth end inside the namespace)."""

    def argv(self, *cmd: str) -> list[str]:
        """cmd run inside this host's namespace."""
        return [IP, "netns", "exec", self.netns, *map(str, cmd)]


@dataclass
class Network:
    """Hosts named by `names`, each in namespace psar-PID-NAME with address 10.213.X.(i+1)/24,
    veth-linked to a bridge in namespace psar-PID-br."""

    names: tuple[str, ...] = ("a", "b", "c")
    prefix: str = field(default_factory=lambda: f"psar-{os.getpid()}")
    subnet: str = field(default_factory=lambda: f"10.213.{os.getpid() % 200 + 20}")
    hosts: dict[str, Host] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def up(self) -> "Network":
        """Build it; on any failure, what was built is torn down and NetnsError raised."""
        try:
            self._add_netns(self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                host = Host(f"{self.prefix}-{name}", f"{self.subnet}.{i + 1}", f"veth-{name}")
                self._add_netns(host.netns)
                # Both ends are born in the bridge's namespace, then one moves to the host's:
                # the root namespace never sees either.
                ip("-n", self.bridge_ns, "link", "add", host.ifname, "type", "veth",
                   "peer", "name", f"port-{name}")
                ip("-n", self.bridge_ns, "link", "set", host.ifname, "netns", host.netns)
                ip("-n", self.bridge_ns, "link", "set", f"port-{name}", "master", "br0")
                ip("-n", self.bridge_ns, "link", "set", f"port-{name}", "up")
                ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
                ip("-n", host.netns, "link", "set", host.ifname, "up")
                self.hosts[name] = host
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Kill whatever still runs in the namespaces (only processes started there, i.e. by
        the caller), then delete them, which deletes their veths and the bridge too.
        Returns what could not be cleaned up (empty when all went)."""
        problems = []
        for netns in reversed(self.created):
            for _ in range(50):
                pids = [int(p) for p in ip("netns", "pids", netns, check=False).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            else:
                problems.append(f"processes {pids} in {netns} would not die")
            res = ip("netns", "del", netns, check=False)
            if res.returncode != 0:
                problems.append(f"`ip netns del {netns}`: {res.stderr.strip()}")
        self.created.clear()
        left = ip("netns", "list", check=False).stdout
        problems += [f"namespace {line.split()[0]} is still there" for line in left.splitlines()
                     if line.split() and line.split()[0].startswith(self.prefix + "-")]
        return problems

    def check_tcp(self, port: int, timeout_s: float = 15.0) -> None:
        """Every host can open a TCP connection to every other host's address (and reads back
        which host answered); raises NetnsError naming the pair that cannot."""
        listen = ("import socket,sys\n"
                  "s=socket.create_server((sys.argv[1],int(sys.argv[2])))\n"
                  "while True:\n"
                  "    c,_=s.accept(); c.sendall(sys.argv[1].encode()); c.close()\n")
        connect = ("import socket,sys,time\n"
                   "end=time.monotonic()+float(sys.argv[2])\n"
                   "for a in sys.argv[3:]:\n"
                   "    while True:\n"
                   "        try:\n"
                   "            with socket.create_connection((a,int(sys.argv[1])),timeout=2) as c:\n"
                   "                got=c.recv(64).decode()\n"
                   "            break\n"
                   "        except OSError as e:\n"
                   "            if time.monotonic()>end: sys.exit(f'{a}: {e}')\n"
                   "            time.sleep(0.1)\n"
                   "    if got!=a: sys.exit(f'{a} answered as {got!r}')\n")
        listeners = []
        try:
            for h in self.hosts.values():
                listeners.append(subprocess.Popen(h.argv(sys.executable, "-c", listen, h.addr, port),
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for src in self.hosts.values():
                others = [h.addr for h in self.hosts.values() if h is not src]
                try:
                    res = subprocess.run(src.argv(sys.executable, "-c", connect, port, timeout_s, *others),
                                         capture_output=True, text=True, timeout=timeout_s + 10)
                except subprocess.TimeoutExpired:
                    raise NetnsError(f"connectivity check from {src.netns} hung") from None
                if res.returncode != 0:
                    raise NetnsError(f"{src.netns} ({src.addr}) cannot reach another host over "
                                     f"TCP port {port}: {res.stderr.strip()}")
        finally:
            for p in listeners:
                p.kill()
                p.wait(timeout=10)
