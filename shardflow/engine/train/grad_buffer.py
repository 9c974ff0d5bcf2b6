"""One flat float32 buffer for the gradients of a rank's parameters, reduced over data parallelism.

Each parameter owns a slice of the buffer. A post-accumulate-grad hook adds the parameter's
gradient into its slice and frees ``param.grad``, so gradients of bf16 parameters accumulate over
micro-batches in float32 and never sit in memory twice.

Data-parallel reduction: the buffer is cut into buckets of whole parameters, laid out in reverse
registration order (roughly the order backward produces them). During the step's final backward,
a bucket whose parameters have all reported starts its all-reduce over the dp group at once, so
communication overlaps the rest of backward. Buckets start strictly in index order, so every
replica issues the same sequence of collectives.

The reduction is a sum: the training loss of each replica is already divided by a count over
all replicas (see ``engine.train.loss_fn``), so the sum is the gradient of the global loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardflow.parallel import comm


class GradBuffer:
    def __init__(self, params: dict[str, nn.Parameter], dp_group: ProcessGroup | None, *,
                 bucket_numel: int, device: torch.device):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.dp_group = dp_group
        self.names = list(reversed(params))  # flat order: roughly the order backward runs
        self.slices: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in self.names:
            self.slices[name] = (offset, offset + params[name].numel())
            offset += params[name].numel()
        self.flat = torch.zeros(offset, dtype=torch.float32, device=device)  # [numel of all params]
        self.views = {n: self.flat[a:b].view(params[n].shape) for n, (a, b) in self.slices.items()}

        # Buckets: runs of whole parameters of about bucket_numel elements.
        self.buckets: list[tuple[int, int]] = []
        self._bucket_of: dict[str, int] = {}
        self._bucket_size: list[int] = []
        start, members = 0, 0
        for name in self.names:
            a, b = self.slices[name]
            self._bucket_of[name] = len(self.buckets)
            members += 1
            if b - start >= bucket_numel or name == self.names[-1]:
                self.buckets.append((start, b))
                self._bucket_size.append(members)
                start, members = b, 0

        self._final = False
        self._pending: list[int] = []
        self._reported: set[str] = set()
        self._next = 0  # first bucket whose all-reduce has not started
        self._works: list = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in params.items()]

    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            self.views[name].add_(param.grad)
            param.grad = None
            if self._final and name not in self._reported:
                self._reported.add(name)
                self._pending[self._bucket_of[name]] -= 1
                self._start_ready()
        return hook

    def zero(self) -> None:
        """Clear the gradients before a step's first backward."""
        assert not self._works, "previous reduction still in flight"
        self.flat.zero_()
        self._final = False

    def begin_final_backward(self) -> None:
        """The next backward is the step's last: buckets reduce as soon as they are complete."""
        self._final = True
        self._pending = list(self._bucket_size)
        self._reported = set()
        self._next = 0

    def _start_ready(self) -> None:
        if self.dp_group is None:
            return
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, index: int) -> None:
        a, b = self.buckets[index]
        # All-reduce (sum) of this bucket over the dp group, asynchronous: backward continues.
        self._works.append(comm.all_reduce_async(self.flat[a:b], self.dp_group))
        self._next = index + 1

    def finish_reduce(self) -> None:
        """Start the buckets that did not complete in backward (in order) and wait for all."""
        if self.dp_group is not None:
            while self._next < len(self.buckets):
                self._start(self._next)
        for work in self._works:
            work.wait()
        self._works = []
        self._final = False

    def close(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
