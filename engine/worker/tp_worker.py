"""A tensor-parallel worker (rank >= 1): loads its shard, then runs every forward rank 0 runs.

Rank 0 sends, over the control group: the ``EngineConfig``, then (once every rank has loaded
its shard) the number of KV blocks, then one message per runner call, ``(runner index, method,
args)`` with index 0 the target and 1 the draft model, and finally ``None`` to stop. The worker
holds no scheduler state: block tables, positions and slots all arrive in the call's spans.

On another machine, start one per rank with the usual environment and no arguments:
``RANK=1 WORLD_SIZE=2 MASTER_ADDR=host0 MASTER_PORT=29500 python -m
pagedspec.engine.worker.tp_worker`` (the model path in rank 0's config must exist on this machine
too).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.distributed import comm
from pagedspec.engine.worker.model_set import load_model_set, make_runner, rank_device


def run_worker(rv: comm.Rendezvous, num_threads: int | None) -> None:
    """The worker's whole life; returns when rank 0 says stop (or raises when it vanishes)."""
    # Ctrl-C reaches every process of the terminal's group: rank 0 alone decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    control = comm.join(rv)
    try:
        config = comm.receive(control)
        assert isinstance(config, EngineConfig)
        device = rank_device(config, rv.local_rank)
        shard = comm.compute_shard(rv, device)
        models = load_model_set(config, device, shard)
        comm.wait_for_all(control)
        num_blocks = comm.receive(control)
        runners = [
            make_runner(models.target.model, models.target.config, config, num_blocks, shard)
        ]
        if models.draft is not None:
            runners.append(
                make_runner(models.draft.model, models.draft.config, config, num_blocks, shard)
            )
        while (message := comm.receive(control)) is not None:
            index, method, args = message
            try:
                getattr(runners[index], method)(*args)
            except (comm.WorkerError, dist.DistError):
                raise
            except Exception:  # noqa: BLE001 - rank 0 raised the same and handles it
                continue
    finally:
        comm.leave()


def main() -> None:
    run_worker(comm.Rendezvous.from_env(), None)


if __name__ == "__main__":
    main()
