"""The zygote forks a run's processes from one that imported torch once: a child runs a script
or a module as `python ARGV` would, with its own environment, arguments and output, and its
exit code (or the signal that killed it) reaches the launcher; a child for an emulated host
runs in that host's network namespace; a bad request is refused without harm; when the
launcher goes, its children go too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.runtime.zygote import Forked, Zygote, can_fork

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = """
import os, sys
import torch
print("argv", sys.argv[1:], "rank", os.environ["RANK"], "torch", torch.tensor([2.0]).double().sum().item())
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def zygote():
    """One for the module's tests (starting one imports torch: seconds here); each test that
    uses it also shows it serves on after the ones before."""
    z = Zygote.start(dict(os.environ))
    yield z
    z.close()


def run(zygote: Zygote, argv, tmp_path, name: str, env=None) -> tuple[Forked, object]:
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    with out, err:
        proc = Forked(zygote, zygote.fork(argv, env or dict(os.environ, RANK="3"), out.fileno(), err.fileno()))
    return proc, lambda kind: (tmp_path / f"{name}.{kind}").read_text()


def test_a_child_runs_a_script_with_its_arguments_environment_output_and_exit_code(zygote, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    ok, ok_text = run(zygote, [sys.executable, str(script), "0", "x"], tmp_path, "ok")
    bad, bad_text = run(zygote, [sys.executable, str(script), "7"], tmp_path, "bad")
    assert ok.wait(60) == 0 and bad.wait(60) == 7
    assert ok_text("out") == "argv ['0', 'x'] rank 3 torch 2.0\n"
    assert ok_text("err") == "to stderr\n"
    assert bad_text("out").startswith("argv ['7'] rank 3")


def test_a_child_has_the_launchers_working_directory_and_its_own_pythonpath(zygote, tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_module.py").write_text("WHO = 'from lib'\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # after the zygote started elsewhere
    Path("here.py").write_text("import os, helper_module\nprint(os.getcwd(), helper_module.WHO)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "lib"))
    proc, text = run(zygote, [sys.executable, "here.py"], tmp_path, "cwd", env=env)
    assert proc.wait(60) == 0, text("err")
    assert text("out") == f"{tmp_path / 'work'} from lib\n"


def test_a_module_an_exception_and_a_signal_give_pythons_exit_codes(zygote, tmp_path):
    module, module_text = run(zygote, [sys.executable, "-m", "json.tool", "--no-such-flag"], tmp_path, "module")
    assert module.wait(60) == 2 and "usage:" in module_text("err")  # argparse's exit
    script = tmp_path / "raises.py"
    script.write_text("raise ValueError('the reason')\n")
    raised, raised_text = run(zygote, [sys.executable, str(script)], tmp_path, "raised")
    assert raised.wait(60) == 1 and "ValueError: the reason" in raised_text("err")
    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    held, held_text = run(zygote, [sys.executable, str(sleeper)], tmp_path, "held")
    time.sleep(0.5)
    held.send_signal(signal.SIGUSR1)  # its stacks go to its log, as the launcher asks before a kill
    time.sleep(0.5)
    held.kill()
    assert held.wait(30) == -signal.SIGKILL
    assert "time.sleep" in held_text("err") or "sleeps.py" in held_text("err")


def test_a_bad_request_is_refused_and_the_zygote_serves_on(zygote, tmp_path):
    with open(tmp_path / "x", "w") as f:
        with pytest.raises(RuntimeError, match="not this interpreter running a module or a script"):
            zygote.fork(["/bin/sh", "-c", "echo hi"], {}, f.fileno(), f.fileno())
        line = json.dumps({"argv": [sys.executable, "x.py"], "env": {}, "cwd": "/", "extra": 1}).encode() + b"\n"
        socket.send_fds(zygote._sock, [line], [f.fileno(), f.fileno()])
        assert "has the fields argv, env, cwd and netns" in zygote._read(30.0, "a refusal")["error"]
        line = json.dumps({"argv": [sys.executable, "x.py"], "env": {}, "cwd": "/", "netns": "../x"}).encode()
        socket.send_fds(zygote._sock, [line + b"\n"], [f.fileno(), f.fileno()])
        assert "is not a network namespace of this host" in zygote._read(30.0, "a refusal")["error"]
        socket.send_fds(zygote._sock, [b"not json\n"], [f.fileno(), f.fileno()])
        assert "not JSON" in zygote._read(30.0, "a refusal")["error"]
    ok, _ = run(zygote, [sys.executable, "-m", "json.tool", "--help"], tmp_path, "after")
    assert ok.wait(60) == 0


def test_children_end_with_the_launcher(tmp_path):
    zygote = Zygote.start(dict(os.environ))
    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    held, _ = run(zygote, [sys.executable, str(sleeper)], tmp_path, "held")
    zygote.close()  # as when the launcher's socket closes
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(held.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"pid {held.pid} outlived its zygote")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
def test_a_child_for_an_emulated_host_runs_in_its_network_namespace(zygote, tmp_path):
    name = f"psar-zt{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        argv = ["ip", "netns", "exec", name, sys.executable, str(tmp_path / "ifs.py")]
        (tmp_path / "ifs.py").write_text("import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n")
        assert can_fork(argv)
        child, read = run(zygote, argv, tmp_path, "ifs")
        assert child.wait(60) == 0
        assert read("out").strip() == "['lo']"  # a new namespace has its loopback alone
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.parametrize("argv,ok", [
    ([sys.executable, "-m", "experiments.runtime.worker", "run"], True),
    ([sys.executable, "train.py", "--epochs", "1"], True),
    (["ip", "netns", "exec", "psar-1", sys.executable, "-m", "x"], False),
    ([sys.executable, "-c", "print(1)"], False),
    ([sys.executable, "-m"], False),
])
def test_what_the_zygote_forks(argv, ok):
    assert can_fork(argv) == ok
