"""A small ConvNet on scikit-learn's bundled 8x8 digits, on psar's engines: run it with
`psar launch --engine ps-sync --workers 2 experiments/examples/convnet_psar.py`. The same
script as convnet_ddp.py but for the lines marked "psar"."""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from experiments import api as psar                                    # psar
from experiments.examples.convnet_ddp import arguments, convnet, digits, make_optimizer


def main() -> torch.nn.Module:
    args = arguments()
    dtype = torch.float64 if args.float64 else torch.float32

    job = psar.init()                                                  # psar
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = convnet().to(dtype)
    saved = torch.load(args.resume, weights_only=True) if args.resume else None
    if saved:
        net.load_state_dict(saved["model"])
    model = job.attach(net, lambda params: make_optimizer(args, params))  # psar
    optimizer = job.optimizer                                          # psar: every engine
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
            parts = list(zip(x.chunk(args.micro), y.chunk(args.micro)))
            for i, (xs, ys) in enumerate(parts):  # all but the last only accumulate
                with job.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():  # psar
                    loss = F.cross_entropy(model(xs), ys) / len(parts)
                    job.backward(loss)                                 # psar
            if args.clip and args.job_clip:
                job.clip_grad_norm_(args.clip)                         # psar: every engine
            elif args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            job.step()                                                 # psar
            scheduler.step()
            mean = loss.detach() * len(parts)
            dist.all_reduce(mean)  # the step's loss (of its last micro-batch), over every rank
            mean /= world
            if step == args.save_at and hasattr(optimizer, "consolidate_state_dict"):
                optimizer.consolidate_state_dict(to=0)  # ZeRO: every rank sends rank 0 its share of the state
            if step == args.save_at and rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),  # psar
                            "scheduler": scheduler.state_dict(), "step": step}, args.save)
            if step == args.steps:
                break
        if step == args.steps:
            break
    job.close()                                                        # psar
    if rank == 0:
        out = os.environ.get("CONVNET_OUT")
        if out:
            torch.save(model.state_dict(), out)                        # psar: the model's own keys
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
