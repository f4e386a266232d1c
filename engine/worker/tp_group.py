"""Rank 0's side of tensor parallelism: starting the workers, mirroring each runner call to
them, noticing when one is gone, and stopping them.

Rank 0 (the engine's process) owns the scheduler, block manager, sampling and speculation.
Every ``ModelRunner`` call it makes (a forward, or a copy-on-write block copy) is first sent to
the workers as one message; they make the same call on their shards, and the layers'
collectives keep the ranks in step. Only rank 0 gets logits (gathered) back.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.distributed import comm
from pagedspec.engine.distributed.comm import WorkerError
from pagedspec.engine.distributed.shard import TPShard
from pagedspec.engine.worker.model_runner import ForwardOutput, ModelRunner
from pagedspec.engine.worker.spans import Span
from pagedspec.engine.worker.tp_worker import run_worker

# How long shutdown waits for a worker to exit by itself before killing it.
_EXIT_WAIT_S = 5.0


class TPGroup:
    """Starts (or, with WORLD_SIZE set, waits for) the workers and joins them as rank 0.

    On one machine workers are spawned here (torch.multiprocessing, spawn) and the CPU threads
    are split evenly between the ranks. With ``RANK=0`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
    ``MASTER_PORT`` in the environment none are spawned: the other ranks join from wherever
    they were started (``python -m pagedspec.engine.worker.tp_worker``).
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size > 1: this process already runs a tensor-parallel engine "
                "(one at a time; shut the other down first)"
            )
        size = config.tensor_parallel_size
        self.processes: list[mp.Process] = []
        self.broken: str | None = None
        self.closed = False
        self.threads_before = torch.get_num_threads()
        if "WORLD_SIZE" in os.environ:
            rv = comm.Rendezvous.from_env()
            if rv.size != size or rv.rank != 0:
                raise ValueError(
                    f"tensor_parallel_size ({size}) must equal WORLD_SIZE ({rv.size}), and the "
                    f"engine must be RANK 0 (got {rv.rank})"
                )
        else:
            rv = comm.Rendezvous(0, size, "127.0.0.1", _free_port(), 0)
            threads = None
            if device.type == "cpu":
                threads = max(1, torch.get_num_threads() // size)
                torch.set_num_threads(threads)
            ctx = mp.get_context("spawn")
            for rank in range(1, size):
                worker = replace(rv, rank=rank, local_rank=rank)
                process = ctx.Process(
                    target=run_worker, args=(worker, threads), name=f"tp-rank{rank}", daemon=True
                )
                process.start()
                self.processes.append(process)
        try:
            self.control = comm.join(rv, self._check_workers)
            comm.send(self.control, config)
            self.shard: TPShard = comm.compute_shard(rv, device)
        except BaseException:
            self.shutdown()
            raise

    def ready(self, num_blocks: int) -> None:
        """Every rank has loaded its shard: tell the workers how many KV blocks to allocate."""
        self._guard(lambda: (comm.wait_for_all(self.control), comm.send(self.control, num_blocks)))

    def call(self, index: int, method: str, args: tuple, local: Callable[..., Any]) -> Any:
        """Send ``runner[index].method(*args)`` to the workers, then make it here."""
        return self._guard(
            lambda: (comm.send(self.control, (index, method, args)), local(*args))[1]
        )

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; a failed collective, a dead worker or an interrupt breaks the group for
        good (raised as WorkerError); any other error is the call's own and the workers, having
        made the same call, raised it too and carry on."""
        if self.broken is None and self._dead():
            self._break(f"tensor-parallel worker(s) died: {self._dead()}")
        if self.broken is not None:
            raise WorkerError(self.broken)
        try:
            return fn()
        except Exception as error:
            if not isinstance(error, WorkerError | dist.DistError) and not self._dead():
                raise
            dead = self._dead()
            what = f"tensor-parallel worker(s) died: {dead}" if dead else str(error)
            self._break(
                f"{what} (a rank that dies, drops out or hangs for more than "
                f"{comm.STEP_TIMEOUT.total_seconds():.0f} s stops the engine)"
            )
            raise WorkerError(self.broken) from error
        except BaseException:  # Ctrl-C mid-call: the ranks are out of step
            self._break("tensor-parallel step interrupted; the ranks are out of step")
            raise

    def _check_workers(self) -> None:
        if dead := self._dead():
            raise WorkerError(f"tensor-parallel worker(s) died while starting: {dead}")

    def _dead(self) -> str:
        return ", ".join(
            f"rank {p.name.removeprefix('tp-rank')} (exit code {p.exitcode})"
            for p in self.processes
            if not p.is_alive()
        )

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers (a clean stop message when the group is healthy, else a kill) and
        leave the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.broken is None and hasattr(self, "control"):
            with contextlib.suppress(Exception):  # a worker that does not stop is killed below
                comm.send(self.control, None)
        for process in self.processes:
            process.join(timeout=_EXIT_WAIT_S if self.broken is None else 0)
            if process.is_alive():
                process.kill()
                process.join()
        comm.leave()
        torch.set_num_threads(self.threads_before)


class DistributedRunner:
    """Rank 0's ``ModelRunner`` under tensor parallelism: every call goes to the workers too."""

    def __init__(self, runner: ModelRunner, index: int, group: TPGroup) -> None:
        self.runner, self.index, self.group = runner, index, group
        self.model, self.device, self.kv_caches = runner.model, runner.device, runner.kv_caches

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.group.call(self.index, "copy_blocks", (pairs,), self.runner.copy_blocks)

    def move_kv(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        if moves:
            self.group.call(self.index, "move_kv", (block_table, moves), self.runner.move_kv)

    def forward(
        self,
        spans: list[Span],
        return_hidden: bool = False,
        features: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        args = (spans, return_hidden, features, hidden_layers)
        return self.group.call(self.index, "forward", args, self.runner.forward)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
