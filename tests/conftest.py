"""Shared helpers: run a real psar job on loopback and read back its final parameters."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from experiments.settings.presets import build_config
from experiments.runtime.launcher import launch, launch_batch, process_shape

@pytest.fixture
def kernel_threads():
    """SGD's compiled kernel's threads (ps.shard.compiled.set_threads: process-wide) put back to
    one after the test, whatever it set."""
    from ps.shard import compiled

    yield
    compiled.set_threads(1)


RUN_DEADLINE_S = 180
POOL_STEPS = 20
"""A pooled job's steps unless it says (None: the experiment's own)."""

FIT_SCRIPT = """
import sys
import torch
from experiments import api as psar

steps = int(sys.argv[1])
job = psar.init()
torch.manual_seed(0)
model = job.attach(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double(),
                   lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
for step in range(job.start_step, steps):
    g = torch.Generator().manual_seed(1000 * step + job.rank)  # each step's batch, whenever it runs
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    job.backward(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())
    job.step()
job.close(lambda m: {"weight_sum": m[0].weight.sum().item()})
"""
"""A user's training script on experiments.api, run with `psar launch ... fit.py STEPS`: its
loop starts at job.start_step, and a step's batch is a function of the step and the rank."""


def run_job(tmp_path: Path, experiment: str, engine: str, workers: int = 2, steps: int = 20,
            overrides=(), name: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Launch a run (bounded by a deadline so a hang fails fast); return summary and state."""
    cfg = build_config(experiment, overrides, engine=engine, workers=workers, steps=steps)
    run_dir = tmp_path / (name or f"{experiment}-{engine}-{workers}-{abs(hash(tuple(overrides)))}")
    summary = launch(cfg, run_dir, deadline_s=RUN_DEADLINE_S, quiet=True)
    state = torch.load(run_dir / "model.pt", weights_only=True)
    return summary, state


def run_jobs(tmp_path: Path, jobs: dict[str, dict]) -> dict[str, tuple[dict, dict]]:
    """Run named jobs (kwargs of build_config plus `experiment`), batched by process count."""
    return _with_parameters(tmp_path, _launch_jobs(tmp_path, jobs))


def _with_parameters(root: Path, summaries: dict[str, dict]) -> dict[str, tuple[dict, dict]]:
    """Each job's summary and final parameters (root/NAME/model.pt), by name."""
    return {name: (summary, torch.load(root / name / "model.pt", weights_only=True))
            for name, summary in summaries.items()}


def _launch_jobs(root: Path, jobs: dict[str, dict], resume: bool = False,
                 errors: dict[str, Exception] | None = None) -> dict[str, dict]:
    """Each job in root/NAME, one launch_batch per process shape; the summaries by name.
    A job's `resume_steps` is for the pool's second round (see Pool), not build_config.

    errors: where a failed batch's jobs go on one at a time, and each failure is kept by the
    job's name (without: the batch's failure is raised)."""
    batches: dict[tuple[int, int], list[tuple[str, object, Path]]] = {}
    for name, job in jobs.items():
        job = dict(job)
        job.pop("resume_steps", None)
        experiment, overrides = job.pop("experiment"), job.pop("overrides", ())
        job.setdefault("steps", POOL_STEPS)
        cfg = build_config(experiment, overrides, **job)
        batches.setdefault(process_shape(cfg), []).append((name, cfg, root / name))
    summaries = {}
    for batch in batches.values():
        try:
            done = launch_batch([(cfg, d) for _, cfg, d in batch], deadline_s=RUN_DEADLINE_S * len(batch),
                                quiet=True, resume=resume)
        except (RuntimeError, OSError, ValueError) as err:
            if errors is None:
                raise
            if len(batch) == 1 or resume:  # a resumed job cannot run again from where it was
                errors.update((name, err) for name, _, _ in batch)
                continue
            failed = len(errors)
            for name, cfg, run_dir in batch:  # which job failed: each alone
                try:
                    summaries[name] = launch_batch([(cfg, run_dir)], deadline_s=RUN_DEADLINE_S, quiet=True)[0]
                except (RuntimeError, OSError, ValueError) as alone:
                    errors[name] = alone
            if len(errors) == failed:  # each passes alone: running them together is what fails
                errors.update((name, RuntimeError(f"failed only in a batch of {len(batch)}: {err}"))
                              for name, _, _ in batch)
            continue
        summaries.update((name, summary) for (name, _, _), summary in zip(batch, done))
    return summaries


class Pool:
    """The jobs of every module under test that declares them (a function POOL_JOBS returning
    run_jobs's dict), run together: one set of processes per process shape for the whole
    session. Starting a process (importing torch: 3 s of CPU here) costs more than most of
    these runs, so the suite pays it once per shape rather than once per module and shape.

    A job with `resume_steps` runs, and is then resumed in its own directory from its last
    checkpoint with steps=resume_steps (a second round, batched the same way).

    A job that fails fails its own module's tests alone: its batch goes on one job at a time.

    A job that several modules declare alike (a reference run: local, the library's all-reduce)
    runs once; the others' directories are links to its own, which the tests only read.
    """

    def __init__(self, root: Path, modules: dict[str, dict[str, dict]]):
        self.root = root
        self.errors: dict[str, Exception] = {}  # by MODULE/NAME
        declared = {f"{module}/{name}": job for module, own in modules.items() for name, job in own.items()}
        first: dict[str, str] = {}  # the job's settings: the first MODULE/NAME declaring them
        alike = {name: first.setdefault(_settings(job), name) for name, job in declared.items()}
        jobs = {name: job for name, job in declared.items() if alike[name] == name}
        self.summaries = _launch_jobs(root, jobs, errors=self.errors)  # by MODULE/NAME
        again = {name: dict(job, steps=job["resume_steps"]) for name, job in jobs.items()
                 if job.get("resume_steps") and name not in self.errors}
        if again:
            self.summaries.update(_launch_jobs(root, again, resume=True, errors=self.errors))
        for name, ran in alike.items():
            if ran != name:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).symlink_to(root / ran, target_is_directory=True)
                if ran in self.errors:
                    self.errors[name] = self.errors[ran]
                elif ran in self.summaries:
                    self.summaries[name] = self.summaries[ran]

    def folder(self, module: str) -> Path:
        """The module's jobs' run directories, root/MODULE/NAME; raises if one of them failed."""
        failed = {name: err for name, err in self.errors.items() if name.split("/")[0] == module}
        if failed:
            name, err = next(iter(failed.items()))
            raise RuntimeError(f"{len(failed)} of {module}'s pooled jobs failed; {name}: {err}") from err
        return self.root / module

    def results(self, module: str) -> dict[str, tuple[dict, dict]]:
        """run_jobs's answer for the module's jobs: (summary, final parameters) by name."""
        folder = self.folder(module)
        own = (name.split("/") + [summary] for name, summary in self.summaries.items())
        return _with_parameters(folder, {name: summary for owner, name, summary in own if owner == module})


def _settings(job: dict) -> str:
    """A pooled job's settings as text, alike for two jobs that run alike."""
    norm = {k: list(v) if isinstance(v, tuple) else v for k, v in job.items()}
    norm.setdefault("steps", POOL_STEPS)
    return repr(sorted(norm.items()))


POOL_TIMEOUT_S = 900


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the group off the marks
def pytest_collection_modifyitems(items):
    """Whichever test first asks for the pool runs every module's jobs in its set-up: each
    test that may be first gets the time for that. Under pytest-xdist (`make test` runs two
    workers) every pooled test goes to one worker, so that the pool runs once."""
    for item in items:
        if _pooled(item):
            item.add_marker(pytest.mark.timeout(POOL_TIMEOUT_S), append=False)
            item.add_marker(pytest.mark.xdist_group("pool"))  # one worker runs the pool, once


def _pooled(item) -> bool:
    """Whether a test asks for the pool: a fixture named pool, in a module with pooled jobs (a
    module's own fixture of that name is not this one)."""
    return "pool" in getattr(item, "fixturenames", ()) and hasattr(getattr(item, "module", None), "POOL_JOBS")


@pytest.fixture(scope="session")
def pool(request, tmp_path_factory) -> Pool:
    """Pool of the modules whose selected tests use this fixture."""
    modules = {}
    for item in request.session.items:
        if _pooled(item) and item.module.__name__ not in modules:
            modules[item.module.__name__] = item.module.POOL_JOBS()
    return Pool(tmp_path_factory.mktemp("pool"), modules)


def wait_for_steps(run_dir: Path, rank: int, steps: int, timeout: float = 150.0) -> None:
    """Until `rank` has logged `steps` steps: kill tests strike mid-run, not before. If a
    process registered with `started` ends first, or the time runs out, the test fails at once
    with every such process's output (they are killed for it)."""
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    deadline = time.monotonic() + timeout
    why = f"did not reach step {steps} within {timeout} s"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        ended = [p for p in STARTED if p.poll() is not None]
        if ended:
            why = f"had not reached step {steps} when a process of the run ended"
            break
        time.sleep(0.1)
    done = len(path.read_text().splitlines()) if path.exists() else 0
    pytest.fail(f"rank {rank} {why} (it logged {done}):\n{_outputs()}", pytrace=False)


def _outputs() -> str:
    """The output of every started process, killing those still running."""
    parts = []
    for proc in STARTED:
        if proc.poll() is None:
            proc.kill()
        try:
            out, _ = proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            out = "(no output)"
        command = " ".join(map(str, proc.args[3:6])) if isinstance(proc.args, list) else str(proc.args)
        parts.append(f"--- {command} (exit {proc.returncode}):\n{(out or '')[-1500:]}")
    return "\n".join(parts)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if a[k].is_floating_point():
            scale = a[k].double().abs().max().item() or 1.0
            worst = max(worst, (a[k].double() - b[k].double()).abs().max().item() / scale)
    return worst


STARTED: list[subprocess.Popen] = []
"""Processes a test started by hand (register them with `started`); killed when it ends."""


def started(proc: subprocess.Popen) -> subprocess.Popen:
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A test that fails half-way must not leave its processes training into the next test."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        try:
            proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")
