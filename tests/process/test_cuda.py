"""The GPU path: NCCL on CUDA. Skipped cleanly on machines without a CUDA device.

NCCL cannot put two ranks on one GPU, so on a one-GPU machine these run one worker per
engine, and compare against the CPU in float64.
"""

from __future__ import annotations

import pytest
import torch

from conftest import max_param_diff, run_jobs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINES = {"local": (), "ddp": (), "allreduce": (), "ring": ("allreduce.algorithm=ring",)}


def test_cuda_engines_match_cpu_in_float64(tmp_path):
    jobs = {"cpu": dict(experiment="cnn", engine="local", workers=1, overrides=("dtype=float64",))}
    for name, extra in ENGINES.items():
        engine = "allreduce" if name == "ring" else name
        jobs[name] = dict(experiment="cnn", engine=engine, workers=1,
                          overrides=("dtype=float64", "device=cuda") + extra)
    results = run_jobs(tmp_path, jobs)
    _, reference = results["cpu"]
    for name in ENGINES:
        # cuDNN and CPU kernels sum in different orders; float64 keeps that far below 1e-8.
        assert max_param_diff(reference, results[name][1]) < 1e-8, name


def test_cuda_quickstart_trains(tmp_path):
    results = run_jobs(tmp_path, {"q": dict(experiment="quickstart", engine="allreduce", workers=1,
                                            steps=100, overrides=("device=cuda",))})
    summary, _ = results["q"]
    assert summary["eval"]["accuracy"] > 0.85
