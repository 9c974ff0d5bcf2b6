"""Start the ranks of a job: spawn them on this machine, or join a torchrun launch.

Every rank runs the same ``entry(world, *args)`` (SPMD). When one rank raises, the others are
terminated and the job ends with that rank's traceback and a non-zero exit; nothing waits on a
dead peer.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardflow.parallel.world import World, init_world

Entry = Callable[..., Any]


class RankFailed(RuntimeError):
    """A rank of a spawned job raised or died; the message holds its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(entry: Entry, nprocs: int, *args: Any, backend: str | None = None) -> Any:
    """Run ``entry(world, *args)`` on every rank.

    Under torchrun this process is one rank of the existing job (``nprocs`` must match its
    world size) and the entry's result is returned. Otherwise ``nprocs`` ranks are spawned and
    rank 0's result is not returned (each rank reports for itself).
    """
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if size != nprocs:
            raise ValueError(f"the job needs {nprocs} ranks but torchrun started {size}")
        world = init_world(int(os.environ["RANK"]), size, "env://", backend,
                           local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        try:
            return entry(world, *args)
        finally:
            dist.destroy_process_group()
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        if torch.cuda.device_count() < nprocs:
            raise ValueError(f"the job needs {nprocs} GPUs but this machine has {torch.cuda.device_count()}")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    try:
        mp.start_processes(_rank_main, args=(entry, nprocs, init_method, backend, args),
                           nprocs=nprocs, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise RankFailed(f"rank {e.error_index} failed:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(f"rank {e.error_index} died with exit code {e.exit_code}") from None
    return None


def _rank_main(rank: int, entry: Entry, size: int, init_method: str, backend: str | None,
               args: tuple) -> None:
    world = init_world(rank, size, init_method, backend)
    if world.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        entry(world, *args)
    finally:
        sys.stdout.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
