"""One parameter-server shard for a run: `python -m experiments.runtime.shard SHARD RUN_DIR [RUN_DIR ...]`.

The shard builds the experiment's model from the same seed as the workers, so every process
derives the same layout and initial values without any being sent; it then serves until
every worker has left. Its counters go to RUN_DIR/metrics/server<SHARD>.json.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from ps.allocator import keep_freed_pages
from ps.cores import core_share, io_threads, local_processes
from ps.easgd import shard_optimizer
from ps.layout import split_values
from ps.security import load_server_keys
from ps.protocol import Limits
from ps.shard import ShardServer, await_init
from ps.transport import ServerTransport, use_io_threads

from experiments.settings import agreement
from experiments.settings import config as config_mod
from experiments.rundir import files
from experiments.rundir.checkpoint import load as load_checkpoint
from experiments.rundir.checkpoint import save_atomic, server_path
from experiments.settings.config import OptimConfig, RunConfig
from experiments.engines import engines, get_engine
from experiments.settings.script import ScriptConfig
from experiments.workloads.sparsity import model_layout
from experiments.rundir.metrics import write_json
from experiments.rundir.tensorboard_log import ShardBoard
from experiments.settings.overrides import to_dict
from experiments.rundir.trace import Tracer
from experiments.runtime.worker import SERVERS_FILE
from experiments.harness.builders import compression


def serve_shard(cfg: RunConfig, shard: int, num_shards: int, bind: str,
                run_dir: Path | None = None, resume: bool = False) -> str:
    """Serve shard `shard` of `num_shards` for `cfg` at `bind`; return why the loop ended.

    With checkpoint.every and a run_dir, the shard saves its state to
    run_dir/checkpoint/server<shard>.pt; resume starts from that file.
    """
    spec = get_engine(cfg.engine)
    if not spec.uses_servers:
        served = [name for name, e in engines().items() if e.uses_servers]
        raise ValueError(f"engine {cfg.engine!r} has no servers; expected one of {', '.join(served)}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
    keep_freed_pages()  # as the workers, before any thread allocates (ps/allocator.py)
    threads = core_share(local_processes(), cfg.threads)  # ps/cores.py: the update's cores
    torch.set_num_threads(threads)  # until the server says how it updates (use_cores)
    io = use_io_threads(io_threads(threads, cfg.workers))  # the connections': before any socket
    tracer = Tracer(run_dir or ".", f"server {shard}", cfg.trace and run_dir is not None)
    path = server_path(run_dir, shard) if run_dir is not None else None

    compressed = compression(cfg)

    easgd = cfg.engine == "ps-easgd"  # the centre: pushes of -d add d, unscaled
    ps_config = replace(cfg.ps, async_scale="sum") if easgd else cfg.ps

    def make(layout, values, optim: OptimConfig) -> ShardServer:
        return ShardServer(shard, layout, values, shard_optimizer if easgd else optim.build, spec.consistency,
                           cfg.workers, ps_config, trace=tracer.record if tracer.enabled else None,
                           reply_delay_s=2 * cfg.fault.delay_s,  # request and reply each pay it
                           checkpoint_every=cfg.checkpoint.every if path else 0,
                           save=lambda state: save_atomic(state, path),
                           settings=agreement.settings(cfg, for_server=True),
                           compressor=compressed[0] if compressed else None,
                           compress_pulls=cfg.compresses_pulls())

    curve = load_server_keys(cfg.ps.curve_dir) if cfg.ps.curve_dir else None
    transport = ServerTransport(bind, cfg.ps.max_message_bytes, cfg.ps.timeout_s, curve=curve)
    try:
        if isinstance(cfg.model, ScriptConfig):  # the script's worker 0 brings the model (and a
            server = await_init(transport, shard, num_shards,
                                lambda layout, values, optim: make(layout, values, OptimConfig(**optim)),
                                cfg.ps.timeout_s, Limits(max_tensor_bytes=cfg.ps.max_message_bytes))
            # resume then replaces what it brought with the checkpoint's, as for an experiment)
        else:
            server = make(*_from_experiment(cfg, shard, num_shards), cfg.optim)
        if resume:
            if path is None:
                raise ValueError("--resume needs the run directory (--out) that holds the checkpoint")
            server.load_state_dict(load_checkpoint(path))
    except BaseException:
        transport.close()
        raise
    torch_threads = server.use_cores(threads)
    logging.getLogger("psar").info("shard %d of %d serving %s at %s", shard, num_shards,
                                   cfg.experiment, transport.address)
    shard_board = ShardBoard(run_dir, to_dict(cfg), shard) if cfg.tensorboard and run_dir is not None else None
    try:
        result = server.serve(transport, report=(ShardBoard.PERIOD_S, shard_board) if shard_board else None)
    finally:
        transport.close()
        tracer.save()
        if shard_board is not None:
            shard_board.close()
    if run_dir is not None:
        (Path(run_dir) / "metrics").mkdir(parents=True, exist_ok=True)
        write_json(Path(run_dir) / "metrics" / f"server{shard}.json",
                   {"result": result, **server.stats(), "threads": threads, "torch_threads": torch_threads,
                    "io_threads": io})
    if server.aborted:
        if path is not None and cfg.checkpoint.every:  # stop cleanly: keep what was learnt
            save_atomic(server.state_dict(), path)
        raise RuntimeError(server.aborted)
    return result


def _from_experiment(cfg: RunConfig, shard: int, num_shards: int):
    """(layout, this shard's initial values) of a named experiment's model, built from the
    same seed as the workers', so that nothing needs to be sent."""
    torch.manual_seed(cfg.seed)  # the workers' initial model, bit for bit
    model = cfg.model.build().to(dtype=cfg.torch_dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layout = model_layout(model, cfg, num_shards)  # the workers' own, bit for bit
    return layout, split_values(layout, [p for _, p in named], shard)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m experiments.runtime.shard [--resume] SHARD RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    shard = int(argv[0])
    for run_dir in map(Path, argv[1:]):
        try:
            cfg = config_mod.load(run_dir / "config.json")
            addresses = files.read_json(run_dir / SERVERS_FILE, what="server list")
            serve_shard(cfg, shard, len(addresses), addresses[shard], run_dir, resume)
        except Exception as err:
            traceback.print_exc()
            print(f"psar: server {shard} failed: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # see experiments.runtime.worker.main
    sys.exit(main(sys.argv[1:]))
