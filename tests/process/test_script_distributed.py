"""A user's script keeps torch.distributed as under torchrun, on every per-process engine:
after psar.init() its own dist.get_rank(), all_reduce and barrier work (under the parameter
servers on a group of the script's alone), and dist.destroy_process_group() after
job.close() ends it cleanly."""

from __future__ import annotations

import json

import pytest

from experiments.api import script_config
from experiments.runtime.launcher import launch_batch

SCRIPT = '''
import json, sys
import torch
import torch.distributed as dist
from experiments import api as psar

job = psar.init()
assert dist.is_initialized(), "no process group after psar.init()"
assert (dist.get_rank(), dist.get_world_size()) == (job.rank, job.world_size)
torch.manual_seed(0)
model = job.attach(torch.nn.Linear(4, 1).double(), lambda p: torch.optim.SGD(p, lr=0.1))
gen = torch.Generator().manual_seed(job.rank)
x = torch.randn(8, 4, dtype=torch.float64, generator=gen)
y = x.sum(1, keepdim=True)
own, means = [], []
for step in job.steps(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    job.backward(loss)
    job.step()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the script's own mean loss, on its own tensor
    own.append(loss.item())
    means.append(total.item() / dist.get_world_size())
    dist.barrier()
job.close()
ones = torch.ones(1, dtype=torch.float64)
dist.all_reduce(ones)
dist.destroy_process_group()
with open(f"{sys.argv[1]}/rank{job.rank}.json", "w") as f:
    json.dump({"own": own, "means": means, "after_close": ones.item()}, f)
'''


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["allreduce", "ddp", "ps-sync", "ps-easgd"])
def test_the_scripts_own_collectives_and_destroy_work_on_every_engine(tmp_path, engine):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "said"
    out.mkdir()
    cfg = script_config(str(script), [str(out)], engine=engine, workers=2)
    launch_batch([(cfg, tmp_path / "run")], deadline_s=60, quiet=True, script=[str(script), str(out)])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["means"] == ranks[1]["means"]
    for step, mean in enumerate(ranks[0]["means"]):
        assert abs(mean - (ranks[0]["own"][step] + ranks[1]["own"][step]) / 2) < 1e-12
    assert ranks[0]["own"] != ranks[1]["own"]  # each rank its own batch: the mean is of two losses
    assert all(r["after_close"] == 2.0 for r in ranks)
