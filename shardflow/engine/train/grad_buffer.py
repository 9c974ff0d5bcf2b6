"""One flat float32 buffer for the gradients of a rank's parameters, reduced over data parallelism.

Each parameter owns a slice of the buffer. A post-accumulate-grad hook takes the parameter's
gradient (``param.grad`` is freed) and, once a few are held, adds them into their slices in one
launch (``engine.train.grad_accumulate``), so gradients of bf16 parameters accumulate over
micro-batches in float32, and at most a group of them sits in memory twice.

Data-parallel reduction: the buffer is cut into buckets of whole parameters, laid out in reverse
registration order (roughly the order backward produces them). During the step's final backward,
a bucket whose parameters have all reported starts its reduction over the dp group at once, so
communication overlaps the rest of backward. Buckets start strictly in index order, so every
replica issues the same sequence of collectives.

Sharded (``shards`` = dp > 1, ZeRO-2 style): each bucket is padded to a multiple of dp and
reduce-scattered, so that replica r receives the summed r-th piece of every bucket in ``part``
(its ``owned`` pieces, which its optimizer updates) for half the traffic of an all-reduce.
Tensors listed in ``whole`` (those fixed up across tp ranks or pipeline stages after backward,
where the peers' pieces would not line up) sit in buckets of their own at the end and are
all-reduced whole; ``collect_owned`` copies their pieces into ``part`` after the fix-ups.

The reduction is a sum: the training loss of each replica is already divided by a count over
all replicas (see ``engine.train.loss_fn``), so the sum is the gradient of the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardflow.engine.train.grad_accumulate import MAX_SOURCES, accumulate_into
from shardflow.parallel import comm

# Gradients held before their group is added: at most MAX_SOURCES, and a flush as soon as they hold
# this many elements (bounds the memory they keep alive: 64 MiB of bf16).
GROUP_NUMEL = 1 << 25


@dataclass(frozen=True)
class Bucket:
    start: int  # [start, stop) of the flat buffer, a multiple of the shard count long
    stop: int
    members: int  # parameters in it
    whole: bool  # all-reduced whole (not reduce-scattered)


@dataclass(frozen=True)
class Piece:
    """A replica's share of one bucket: ``flat[lo:hi]`` is ``part[at:at + hi - lo]``."""

    lo: int
    hi: int
    at: int


class GradBuffer:
    def __init__(self, params: dict[str, nn.Parameter], dp_group: ProcessGroup | None, *,
                 bucket_numel: int, device: torch.device, shards: int = 1, shard_index: int = 0,
                 whole: frozenset[str] = frozenset()):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.dp_group, self.shards = dp_group, shards
        order = list(reversed(params))  # flat order: roughly the order backward runs
        self.names = [n for n in order if n not in whole] + [n for n in order if n in whole]
        self.slices: dict[str, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[str, int] = {}
        offset, start, members = 0, 0, 0
        for i, name in enumerate(self.names):
            self.slices[name] = (offset, offset + params[name].numel())
            offset += params[name].numel()
            self._bucket_of[name] = len(self.buckets)
            members += 1
            last = i == len(self.names) - 1
            if last or offset - start >= bucket_numel or (self.names[i + 1] in whole) != (name in whole):
                offset = start + -(-(offset - start) // shards) * shards  # padded to a multiple of shards
                self.buckets.append(Bucket(start, offset, members, name in whole))
                start, members = offset, 0
        self.flat = torch.zeros(offset, dtype=torch.float32, device=device)  # [numel of all params + padding]
        self.views = {n: self.flat[a:b].view(params[n].shape) for n, (a, b) in self.slices.items()}

        # This replica's pieces: everything when unsharded, else the shard_index-th of each bucket.
        self.pieces: list[Piece] = []
        if shards == 1:
            self.pieces.append(Piece(0, offset, 0))
        else:
            at = 0
            for b in self.buckets:
                size = (b.stop - b.start) // shards
                self.pieces.append(Piece(b.start + shard_index * size, b.start + (shard_index + 1) * size, at))
                at += size
        # The reduced gradient of the owned pieces, laid out like the optimizer's state.
        self.part = self.flat if shards == 1 else torch.zeros(self.pieces[-1].at + self.pieces[-1].hi
                                                              - self.pieces[-1].lo, device=device)

        self._final = False
        self._pending: list[int] = []
        self._reported: set[str] = set()
        self._next = 0  # first bucket whose reduction has not started
        self._works: list = []
        self._group: list[tuple[int, torch.Tensor]] = []  # (offset in flat, gradient) not yet added
        self._group_numel = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in params.items()]

    # ----- layout helpers --------------------------------------------------------------------

    def owned_of(self, full: torch.Tensor) -> torch.Tensor:
        """This replica's pieces of ``full`` (a tensor laid out like ``flat``), laid out like ``part``."""
        if self.shards == 1:
            return full
        return torch.cat([full[p.lo:p.hi] for p in self.pieces])

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """The flat layout from every replica's ``part``-shaped tensor, stacked [shards, part numel]
        in dp group rank order (what an all-gather returns)."""
        if self.shards == 1:
            return gathered[0]
        return torch.cat([gathered[:, p.at:p.at + p.hi - p.lo].reshape(-1) for p in self.pieces])

    def spans(self, name: str) -> list[tuple[int, int, int]]:
        """Where the owned elements of parameter ``name`` are: (first element of the parameter,
        first in ``part``, count) per run."""
        a, b = self.slices[name]
        return [(lo - a, p.at + lo - p.lo, hi - lo) for p in self.pieces
                for lo, hi in [(max(a, p.lo), min(b, p.hi))] if lo < hi]

    def part_views(self, part: torch.Tensor, names) -> list[torch.Tensor]:
        """Views of ``part`` (laid out like ``self.part``) over the owned elements of ``names``."""
        return [part[at:at + n] for name in names for _, at, n in self.spans(name)]

    # ----- accumulation and reduction -----------------------------------------------------------

    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            self._group.append((self.slices[name][0], param.grad))
            self._group_numel += param.grad.numel()
            param.grad = None
            if len(self._group) == MAX_SOURCES or self._group_numel >= GROUP_NUMEL:
                self.flush()
            if self._final and name not in self._reported:
                self._reported.add(name)
                self._pending[self._bucket_of[name]] -= 1
                self._start_ready()
        return hook

    def flush(self) -> None:
        """Add the gradients the hooks hold into the buffer."""
        if self._group:
            offsets, grads = zip(*self._group)
            accumulate_into(self.flat, offsets, grads)
            self._group, self._group_numel = [], 0

    def zero(self) -> None:
        """Clear the gradients before a step's first backward."""
        assert not self._works, "previous reduction still in flight"
        self._group, self._group_numel = [], 0
        self.flat.zero_()
        self._final = False

    def begin_final_backward(self) -> None:
        """The next backward is the step's last: buckets reduce as soon as they are complete."""
        self._final = True
        self._pending = [b.members for b in self.buckets]
        self._reported = set()
        self._next = 0

    def _start_ready(self) -> None:
        if self.dp_group is None:
            return
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, index: int) -> None:
        self.flush()  # the bucket's gradients, some maybe still held
        b = self.buckets[index]
        # asynchronous: backward continues
        if self.shards > 1 and not b.whole:
            p = self.pieces[index]
            self._works.append(comm.reduce_scatter_async(self.part[p.at:p.at + p.hi - p.lo],
                                                         self.flat[b.start:b.stop], self.dp_group))
        else:
            self._works.append(comm.all_reduce_async(self.flat[b.start:b.stop], self.dp_group))
        self._next = index + 1

    def finish_reduce(self) -> None:
        """Start the buckets that did not complete in backward (in order) and wait for all."""
        self.flush()
        if self.dp_group is not None:
            while self._next < len(self.buckets):
                self._start(self._next)
        for work in self._works:
            work.wait()
        self._works = []
        self._final = False

    def collect_owned(self) -> None:
        """Sharded: copy the owned pieces of the all-reduced (``whole``) buckets into ``part``."""
        if self.shards == 1:
            return
        for b, p in zip(self.buckets, self.pieces):
            if b.whole:
                self.part[p.at:p.at + p.hi - p.lo] = self.flat[p.lo:p.hi]

    def close(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
