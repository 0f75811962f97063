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
                  "ends=[]; errors=[]\n"
                  "def take(c):\n"
                  "    got=0\n"
                  "    try:\n"
                  "        while got<n:\n"
                  "            b=c.recv(1<<20)\n"
                  "            if not b: raise ConnectionError('closed')\n"
                  "            got+=len(b)\n"
                  "        ends.append(time.time()); c.sendall(b'k')\n"
                  "    except Exception as e: errors.append(f'{me}: from a peer, {got} of {n} bytes in: {e!r}')\n"
                  "takers=[threading.Thread(target=take,args=(srv.accept()[0],)) for _ in peers]\n"
                  "time.sleep(max(0,start-time.time()))\n"
                  "buf=bytes(n)\n"
                  "def give(c,p):\n"
                  "    try:\n"
                  "        c.sendall(buf)\n"
                  "        if c.recv(1)!=b'k': raise ConnectionError('no acknowledgement')\n"
                  "    except Exception as e: errors.append(f'{me}: to {p}: {e!r}')\n"
                  "givers=[threading.Thread(target=give,args=(c,p)) for c,p in zip(conns,peers)]\n"
                  "for t in takers+givers: t.start()\n"
                  "for t in takers+givers: t.join(max(0,start+limit-time.time()))\n"
                  "if errors or len(ends)<len(peers): sys.exit('; '.join(errors) or f'{me}: a peer did not finish')\n"
                  "print(max(ends+[time.time()])-start)\n")
        start = time.time() + 2.0 + 0.3 * len(self.hosts)
        procs = {name: subprocess.Popen(h.argv(sys.executable, "-c", script, h.addr, port, nbytes, start, timeout_s,
                                               *[o.addr for o in self.hosts.values() if o is not h]),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, h in self.hosts.items()}
        outs = _outputs("all-to-all", procs, start + timeout_s, f"within {timeout_s:g} s")
        return {name: float(out.split()[-1]) for name, out in outs.items()}

    def incast(self, receiver: str, nbytes: int, port: int, rounds: int, gap_s: float,
               timeout_s: float = 60.0) -> list[float]:
        """Every host but `receiver` sends it nbytes at once, `rounds` times, over connections
        opened beforehand: the receiver starts each round gap_s after the last one ended (each
        sender's flow idle meanwhile, as a worker's is during its compute) with a byte to every
        sender, and times it until it has all of that round's bytes (bare TCP, the pattern of a
        parameter server's pushes into one shard). Returns the seconds of each round; raises
        NetworkError naming a host that fails and, from the receiver, the sender it waited on."""
        take = ("import socket,sys,threading,time\n"
                "me,port,n,rounds,gap,limit=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),int(sys.argv[4]),"
                "float(sys.argv[5]),float(sys.argv[6])\n"
                "names=dict(a.split('=') for a in sys.argv[7:])\n"
                "srv=socket.create_server((me,port)); srv.settimeout(limit)\n"
                "conns=[]\n"
                "for _ in names:\n"
                "    c,(addr,_p)=srv.accept(); c.settimeout(limit); conns.append((c,names.get(addr,addr)))\n"
                "errors=[]\n"
                "def take(c,who,r):\n"
                "    got=0\n"
                "    try:\n"
                "        while got<n:\n"
                "            b=c.recv(min(1<<20,n-got))\n"
                "            if not b: raise ConnectionError('closed')\n"
                "            got+=len(b)\n"
                "    except Exception as e: errors.append(f'{who} in round {r}, {got} of {n} bytes in: {e!r}')\n"
                "times=[]\n"
                "for r in range(rounds):\n"
                "    time.sleep(gap)\n"
                "    ts=[threading.Thread(target=take,args=(c,who,r)) for c,who in conns]\n"
                "    for t in ts: t.start()\n"
                "    t0=time.time()\n"
                "    for c,who in conns: c.sendall(b'g')\n"
                "    for t in ts: t.join()\n"
                "    if errors: sys.exit('; '.join(errors))\n"
                "    times.append(time.time()-t0)\n"
                "print(' '.join(map(str,times)))\n")
        give = ("import socket,sys,time\n"
                "to,port,n,rounds,limit=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),int(sys.argv[4]),"
                "float(sys.argv[5])\n"
                "end=time.time()+10\n"
                "while True:\n"
                "    try: c=socket.create_connection((to,port),timeout=2); break\n"
                "    except OSError as e:\n"
                "        if time.time()>end: sys.exit(f'{to}: {e}')\n"
                "        time.sleep(0.05)\n"
                "c.settimeout(limit)\n"
                "buf=bytes(n)\n"
                "for r in range(rounds):\n"
                "    if c.recv(1)!=b'g': sys.exit(f'{to} did not start round {r}')\n"
                "    c.sendall(buf)\n"
                "c.close()\n")
        sink = self.hosts[receiver]
        senders = [h for name, h in self.hosts.items() if name != receiver]
        procs = {receiver: subprocess.Popen(sink.argv(sys.executable, "-c", take, sink.addr, port, nbytes, rounds,
                                                      gap_s, timeout_s, *[f"{h.addr}={h.name}" for h in senders]),
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
        time.sleep(0.3)  # listening before the senders connect (they try for 10 s)
        for h in senders:
            procs[h.name] = subprocess.Popen(h.argv(sys.executable, "-c", give, sink.addr, port, nbytes, rounds,
                                                    timeout_s),
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        longest = 15 + rounds * (gap_s + timeout_s)  # every wait bounded by timeout_s
        outs = _outputs("incast", procs, time.time() + longest, f"within {longest:g} s")
        return [float(x) for x in outs[receiver].split()]


def _outputs(probe: str, procs: dict[str, subprocess.Popen], deadline: float, within: str) -> dict[str, str]:
    """Each host's standard output once its probe process ends, by host; NetworkError naming
    the probe and a host that fails or is still running at `deadline` (time.time()); every
    process killed on the way out."""
    outs = {}
    try:
        for name, proc in procs.items():
            try:
                outs[name], err = proc.communicate(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise NetworkError(f"{probe}: host {name} did not finish {within}") from None
            if proc.returncode != 0:
                raise NetworkError(f"{probe}: host {name} failed: {(err or '').strip()[-300:]}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return outs
