"""Probes of an emulated cluster (experiments/runtime/netns.py's Network): every host reaches
every other over TCP, and what all of them move at once. A mixin of Network, whose hosts and
addresses it reads."""

from __future__ import annotations

import subprocess
import sys
import time

from experiments.runtime.iproute import NetworkError


class Probes:
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
                    raise NetworkError(f"connectivity check from {src.netns} hung") from None
                if res.returncode != 0:
                    raise NetworkError(f"{src.netns} ({src.addr}) cannot reach another host over "
                                     f"TCP port {port}: {res.stderr.strip()}")
        finally:
            for p in listeners:
                p.kill()
                p.wait(timeout=10)

    def all_to_all(self, nbytes: int, port: int, timeout_s: float = 60.0) -> dict[str, float]:
        """Every host sends nbytes to every other host at once, over connections opened
        beforehand, and reads what they send it: the seconds from the common start until each
        host has all its bytes acknowledged and all the others' in (bare TCP, the traffic of
        co-located shards without psar). Raises NetworkError naming a host that fails."""
        # Listeners first, connections a second before the common start, the bytes at it.
        script = ("import socket,sys,threading,time\n"
                  "me,port,n,start,limit=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),float(sys.argv[4]),"
                  "float(sys.argv[5])\n"
                  "peers=sys.argv[6:]\n"
                  "srv=socket.create_server((me,port)); srv.settimeout(start+limit-time.time())\n"
                  "time.sleep(max(0,start-1-time.time()))\n"
                  "conns=[socket.create_connection((p,port),timeout=10) for p in peers]\n"
                  "ends=[]\n"
                  "def take(c):\n"
                  "    got=0\n"
                  "    while got<n:\n"
                  "        b=c.recv(1<<20)\n"
                  "        if not b: sys.exit(f'{me}: a peer closed after {got} of {n} bytes')\n"
                  "        got+=len(b)\n"
                  "    ends.append(time.time()); c.sendall(b'k')\n"
                  "takers=[threading.Thread(target=take,args=(srv.accept()[0],)) for _ in peers]\n"
                  "time.sleep(max(0,start-time.time()))\n"
                  "buf=bytes(n)\n"
                  "def give(c):\n"
                  "    c.sendall(buf)\n"
                  "    if c.recv(1)!=b'k': sys.exit(f'{me}: no acknowledgement')\n"
                  "givers=[threading.Thread(target=give,args=(c,)) for c in conns]\n"
                  "for t in takers+givers: t.start()\n"
                  "for t in takers+givers: t.join(start+limit-time.time())\n"
                  "print(max(ends+[time.time()])-start)\n")
        start = time.time() + 2.0 + 0.3 * len(self.hosts)
        procs = {name: subprocess.Popen(h.argv(sys.executable, "-c", script, h.addr, port, nbytes, start, timeout_s,
                                               *[o.addr for o in self.hosts.values() if o is not h]),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, h in self.hosts.items()}
        seconds = {}
        try:
            for name, proc in procs.items():
                try:
                    out, err = proc.communicate(timeout=max(1.0, start + timeout_s - time.time()))
                except subprocess.TimeoutExpired:
                    raise NetworkError(f"all-to-all: host {name} did not finish within {timeout_s:g} s") from None
                if proc.returncode != 0:
                    raise NetworkError(f"all-to-all: host {name} failed: {err.strip()[-300:]}")
                seconds[name] = float(out.split()[-1])
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
        return seconds
