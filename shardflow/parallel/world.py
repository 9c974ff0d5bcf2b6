"""This process's place in the job: rank, device, and the process-group cache.

``new_group`` is collective over the whole job, so groups are created up front, in one fixed
order (sorted by size, then ranks), by every rank, and cached by their rank tuple. Asking for a
group that was not created is a bug in the caller, reported as such instead of a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class GroupCache:
    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    def create(self, rank_tuples: Iterable[tuple[int, ...]]) -> None:
        """Create every missing group. All ranks must call this with the same tuples."""
        wanted = sorted({tuple(sorted(t)) for t in rank_tuples if len(t) > 1}, key=lambda g: (len(g), g))
        for ranks in wanted:
            if ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks))

    def get(self, ranks: tuple[int, ...]) -> ProcessGroup | None:
        """The group of these ranks; None for a single rank (nothing to communicate)."""
        if len(ranks) <= 1:
            return None
        key = tuple(sorted(ranks))
        try:
            return self._groups[key]
        except KeyError:
            raise RuntimeError(
                f"process group {key} was never created; call World.create_groups with every layout "
                "before running calls that use it"
            ) from None

    def __len__(self) -> int:
        return len(self._groups)


@dataclass
class World:
    rank: int
    size: int
    device: torch.device
    backend: str
    groups: GroupCache = field(default_factory=GroupCache)

    def create_groups(self, layouts: Iterable) -> None:
        """Create the groups of every layout (tp, dp, pp and whole-layout groups)."""
        self.groups.create(g for layout in layouts for g in layout.groups())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("SHARDFLOW_COMM_TIMEOUT", "600")))


def init_world(rank: int, size: int, init_method: str, backend: str | None = None,
               local_rank: int | None = None) -> World:
    """Join the job's default process group and pick this rank's device.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = rank if local_rank is None else local_rank
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=default_timeout(), **kwargs)
    return World(rank=rank, size=size, device=device, backend=backend)
