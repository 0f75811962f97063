"""A small ConvNet on scikit-learn's bundled 8x8 digits, as plain DDP: run it with
`torchrun --nproc-per-node 2 -m experiments.examples.convnet_ddp`. convnet_psar.py is the
same script on psar's engines; docs/your-own-script.md shows the lines that differ."""

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from experiments.workloads.datasets import load_digits_arrays


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def digits(dtype: torch.dtype) -> TensorDataset:
    pixels, labels = load_digits_arrays()
    x = torch.from_numpy(pixels).to(dtype).view(-1, 1, 8, 8) / 16
    return TensorDataset(x, torch.from_numpy(labels))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient's norm to this (0: no)")
    parser.add_argument("--lr-step", type=int, default=0, help="halve the learning rate every this many steps")
    parser.add_argument("--micro", type=int, default=1, help="micro-batches a step accumulates")
    parser.add_argument("--job-clip", action="store_true", help="convnet_psar.py: clip with job.clip_grad_norm_")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--save", default="", help="write a checkpoint here (model, optimizer, schedule, step)")
    parser.add_argument("--save-at", type=int, default=0, help="... after this many steps")
    parser.add_argument("--resume", default="", help="go on from this checkpoint")
    parser.add_argument("--zero-redundancy", action="store_true",
                        help="convnet_ddp.py: shard the optimizer with torch's ZeroRedundancyOptimizer")
    return parser.parse_args()


def make_optimizer(args: argparse.Namespace, params) -> torch.optim.Optimizer:
    cls, settings = (torch.optim.AdamW, {"weight_decay": 0.01}) if args.optimizer == "adamw" else (torch.optim.SGD, {})
    if args.zero_redundancy:  # torch's own ZeRO stage 1: each rank steps the state of its share
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=args.lr, **settings)
    return cls(params, lr=args.lr, **settings)


def main() -> torch.nn.Module:
    args = arguments()
    dtype = torch.float64 if args.float64 else torch.float32

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = convnet().to(dtype)
    saved = torch.load(args.resume, weights_only=True) if args.resume else None
    if saved:
        net.load_state_dict(saved["model"])
    model = DistributedDataParallel(net)
    optimizer = make_optimizer(args, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_step or 1 << 30, gamma=0.5)
    if saved:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    data = digits(dtype)
    sampler = DistributedSampler(data, world, rank, seed=0)
    step, done = 0, saved["step"] if saved else 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True):
            step += 1
            if step <= done:  # trained on before the checkpoint
                continue
            optimizer.zero_grad()
            parts = list(zip(x.chunk(args.micro), y.chunk(args.micro)))
            for i, (xs, ys) in enumerate(parts):  # all but the last only accumulate
                with model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                    loss = F.cross_entropy(model(xs), ys) / len(parts)
                    loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            mean = loss.detach() * len(parts)
            dist.all_reduce(mean)  # the step's loss (of its last micro-batch), over every rank
            mean /= world
            if step == args.save_at and hasattr(optimizer, "consolidate_state_dict"):
                optimizer.consolidate_state_dict(to=0)  # ZeRO: every rank sends rank 0 its share of the state
            if step == args.save_at and rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step}, args.save)
            if step == args.steps:
                break
        if step == args.steps:
            break
    if rank == 0:
        out = os.environ.get("CONVNET_OUT")
        if out:
            torch.save(model.module.state_dict(), out)
        print(f"rank 0: {step} steps, mean loss {mean.item():.6f}")
    dist.barrier()  # both ranks tear Gloo down together (one leaving mid-save aborted the other)
    dist.destroy_process_group()
    return model  # freed by the exit below, not here: see there


if __name__ == "__main__":
    kept = main()
    # With torch 2.13 and Gloo a rank sometimes aborts in the interpreter's own teardown after
    # destroy_process_group ("terminate called without an active exception", no Python frame;
    # 2 to 3 of 12 runs with both cores busy), and DDP's reducer freed after it can hang the rank
    # in native code (1 of 12 torchrun runs with both cores busy, the rank's only frame this
    # line, main() returned). Everything is written by then: leave at once, the model kept.
    sys.stdout.flush()
    os._exit(0)
