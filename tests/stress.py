"""Shake out timing bugs: run test files K times, optionally with every core kept busy, and
print each test's passes and failures. `make stress` runs it; not part of `make test`.

    python tests/stress.py [--rounds K] [--load] [--out DIR] [FILE ...]

Each round is one pytest run of the files (default: the ones that start processes and
depend on timing). --load starts one busy process per core for the whole time, so that the
processes under test are preempted as on a loaded or oversubscribed machine. A failing round's
output is kept in DIR/round<K>.log. Exit status 1 if any test failed in any round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/process/test_ps_processes.py", "tests/process/test_ps_restart.py",
         "tests/process/test_process_loss.py", "tests/process/test_multihost.py",
         "tests/unit/test_ps_cluster.py", "tests/process/test_files.py", "tests/process/test_network.py",
         "tests/process/test_racks.py", "tests/process/test_teardown.py", "tests/process/test_zygote.py",
         "tests/process/test_faults.py")


def _spin() -> None:
    while True:
        pass


def outcomes(junit: Path) -> dict[str, tuple[str, float]]:
    """{test id: (passed|failed|skipped, seconds)} from pytest's JUnit XML report."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        else:
            state = "passed"
        found[name] = (state, float(case.get("time") or 0.0))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(FILES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--load", action="store_true", help="keep every core busy meanwhile")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "stress")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)] if args.load else []
    for s in spinners:
        s.start()
    table: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    bad_rounds = []
    started = time.monotonic()
    try:
        for k in range(1, args.rounds + 1):
            junit, log = args.out / f"round{k}.xml", args.out / f"round{k}.log"
            t0 = time.monotonic()
            with open(log, "w") as out:
                code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                        f"--junitxml={junit}", *args.files],
                                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            results = outcomes(junit) if junit.exists() else {}
            for name, (state, seconds) in results.items():
                table[name][state].append(seconds)
            failed = sorted(n for n, (s, _) in results.items() if s == "failed")
            if code != 0:
                bad_rounds.append(k)
                failed = failed or [f"pytest exit {code}, no report"]
            else:
                log.unlink()
            junit.unlink(missing_ok=True)
            print(f"round {k}/{args.rounds}: {len(results)} tests, {len(failed)} failed "
                  f"({time.monotonic() - t0:.0f} s){': ' + ', '.join(failed) if failed else ''}", flush=True)
    finally:
        for s in spinners:
            s.kill()
    print(f"\n{args.rounds} rounds{' under load (' + str(len(spinners)) + ' busy processes)' if spinners else ''}"
          f" in {time.monotonic() - started:.0f} s")
    print(f"{'test':<90} {'pass':>5} {'fail':>5} {'skip':>5} {'max s':>7}")
    for name in sorted(table):
        row = table[name]
        worst = max((t for ts in row.values() for t in ts), default=0.0)
        print(f"{name:<90} {len(row['passed']):>5} {len(row['failed']):>5} {len(row['skipped']):>5} {worst:>7.1f}")
    if bad_rounds:
        print(f"failing rounds: {bad_rounds}; their output: {args.out}/round<K>.log")
    return 1 if bad_rounds else 0


if __name__ == "__main__":
    sys.exit(main())
