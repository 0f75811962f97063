"""A small character-level GPT on the Python standard library's own source, on psar's
engines: `psar launch --engine ps-async --workers 2 experiments/examples/gpt_psar.py --steps 50`.
The model and text come from psar's gpt-char experiment; the loop is the script's own.

With `--set checkpoint.every=20` every rank checkpoints every 20 steps, and
`psar launch --resume RUN_DIR experiments/examples/gpt_psar.py --steps 100` goes on from the
last one: the loop starts at job.start_step. job.close() runs test_loss on the final model and
puts it in summary.json's "eval"."""

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from experiments import api as psar
from experiments.workloads.data import CharCorpusConfig
from experiments.workloads.models import GPTConfig


def test_loss(model: torch.nn.Module, corpus, device: torch.device) -> dict:
    """Mean next-character cross-entropy over the held-out windows."""
    model.eval()
    with torch.no_grad():
        (x,), y = corpus.test, corpus.test_targets
        logits = torch.cat([model(part.to(device)) for part in x.split(256)])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
    model.train()
    return {"test_loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    job = psar.init()
    corpus = CharCorpusConfig().build(seed=0)
    torch.manual_seed(0)
    model = job.attach(GPTConfig().build().to(job.device),
                       lambda params: torch.optim.AdamW(params, lr=args.lr))
    data = TensorDataset(*corpus.train, corpus.train_targets)
    sampler = DistributedSampler(data, job.world_size, job.rank, seed=0)
    step = job.start_step  # 0, or where the checkpoint left off
    epoch, done = divmod(step, len(sampler) // args.batch_size)
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        for x, y in itertools.islice(batches, done, None):  # the batches of this epoch not yet done
            logits = model(x.to(job.device))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(job.device).reshape(-1))
            job.backward(loss)
            job.step()
            step += 1
            if step == args.steps:
                break
        epoch, done = epoch + 1, 0
    summary = job.close(lambda m: test_loss(m, corpus, job.device))
    if summary:
        print(f"final loss {summary['final_loss']:.3f}, test loss {summary['eval']['test_loss']:.3f} "
              f"after {summary['steps']} steps")


if __name__ == "__main__":
    main()
