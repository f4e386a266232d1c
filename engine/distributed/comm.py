"""Joining the tensor-parallel ranks and rank 0's messages to the workers.

Every rank makes the same three process groups, in the same order:

- the default group (gloo; rendezvous over TCP at ``addr:port``), used only at start-up: its
  long timeout covers spawning, imports and model loading;
- ``compute`` (NCCL on CUDA, gloo on the CPU): the layers' all-reduces and the logits gather.
  Ranks run a forward in lockstep, so a collective that waits ``STEP_TIMEOUT`` means a rank
  hung: it raises instead of waiting forever;
- ``control`` (always gloo, CPU): rank 0's per-forward message, a pickled object broadcast
  (``broadcast_object_list``). Workers wait here between steps, for as long as the engine
  sits idle, hence their very long timeout; rank 0's side has ``STEP_TIMEOUT`` (a gloo send
  to a hung worker blocks). It works the same within one machine and across machines, which
  shared memory would not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedspec.engine.distributed.shard import TPShard

STARTUP_TIMEOUT = timedelta(minutes=10)
STEP_TIMEOUT = timedelta(seconds=20)
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a rank joins: torch.distributed's usual environment variables."""

    rank: int
    size: int
    addr: str
    port: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Rendezvous:
        """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK, default RANK)."""
        missing = [
            v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
        ]
        if missing:
            raise ValueError(f"tensor-parallel rank needs the environment variables {missing}")
        rank = int(os.environ["RANK"])
        return cls(
            rank,
            int(os.environ["WORLD_SIZE"]),
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ.get("LOCAL_RANK", rank)),
        )


def join(rv: Rendezvous, check_workers: Callable[[], None] | None = None) -> dist.ProcessGroup:
    """Join the group (the default group is gloo); returns ``control``. Rank 0 waits for the
    others to check in at its TCP store, calling ``check_workers`` (which raises when a
    spawned worker died, e.g. at import) meanwhile instead of waiting out the timeout."""
    is_master = rv.rank == 0
    store = dist.TCPStore(
        rv.addr, rv.port, rv.size, is_master, timeout=STARTUP_TIMEOUT, wait_for_workers=False
    )
    store.add("joined", 1)
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while is_master and store.add("joined", 0) < rv.size:
        if check_workers is not None:
            check_workers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks did not all join within {STARTUP_TIMEOUT}")
        time.sleep(0.05)
    dist.init_process_group(
        "gloo", store=store, rank=rv.rank, world_size=rv.size, timeout=STARTUP_TIMEOUT
    )
    # Timeouts are each rank's own: rank 0's sends are bounded, workers wait indefinitely.
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT if rv.rank else STEP_TIMEOUT)


def compute_shard(rv: Rendezvous, device: torch.device) -> TPShard:
    """This rank's shard, its ``group`` the ``compute`` group for ``device`` (every rank calls
    this once rank 0 has sent the config, which decides the device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    return TPShard(rv.rank, rv.size, dist.new_group(backend=backend, timeout=STEP_TIMEOUT))


class WorkerError(RuntimeError):
    """A tensor-parallel rank died, hung or dropped out: this engine cannot continue."""


def collective(op: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Run a torch.distributed op; its failure (gloo raises plain RuntimeErrors, for a closed
    connection as for a timeout) becomes a WorkerError, which no caller mistakes for a bad
    request."""
    try:
        op(*args, **kwargs)
    except RuntimeError as error:
        raise WorkerError(f"a tensor-parallel collective failed: {error}") from error


def send(control: dist.ProcessGroup, message: object) -> None:
    """Rank 0: one message to every worker."""
    collective(dist.broadcast_object_list, [message], src=0, group=control)


def receive(control: dist.ProcessGroup) -> object:
    """A worker: the next message from rank 0."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def wait_for_all(control: dist.ProcessGroup) -> None:
    """Every rank has loaded its shard (raises, naming a rank, if one fails or takes too long)."""
    collective(dist.monitored_barrier, group=control, timeout=STARTUP_TIMEOUT)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
