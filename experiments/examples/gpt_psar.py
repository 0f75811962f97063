"""A small character-level GPT on the Python standard library's own source, on psar's
engines: `psar launch --engine ps-async --workers 2 experiments/examples/gpt_psar.py --steps 50`.
The model and text come from psar's gpt-char experiment; the loop is the script's own."""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from experiments import api as psar
from experiments.data import CharCorpusConfig
from experiments.models import GPTConfig


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
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True):
            logits = model(x.to(job.device))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(job.device).reshape(-1))
            job.backward(loss)
            job.step()
            step += 1
            if step == args.steps:
                break
        epoch += 1
    summary = job.close()
    if summary:
        print(f"final loss {summary['final_loss']:.3f} after {summary['steps']} steps")


if __name__ == "__main__":
    main()
