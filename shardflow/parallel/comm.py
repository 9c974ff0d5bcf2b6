"""Collectives used by the model, counted, and their autograd forms.

Every collective of the model goes through this module, so that a test can count them
(``with count_collectives() as counts: ...``) and an accidental extra all-gather fails it.
A ``group`` of None means a single rank: nothing is communicated.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

_counters: list[Counter] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count collectives issued inside the block, by kind (``all_reduce``, ``all_gather``, ...)."""
    counter: Counter = Counter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _count(kind: str) -> None:
    for c in _counters:
        c[kind] += 1


def all_reduce(t: torch.Tensor, group: ProcessGroup | None, op: ReduceOp.RedOpType = ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns ``t``."""
    if group is not None:
        _count("all_reduce")
        dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_async(t: torch.Tensor, group: ProcessGroup | None) -> dist.Work | None:
    """Start an in-place sum over the group; returns the handle to ``wait()`` on (None: no group)."""
    if group is None:
        return None
    _count("all_reduce")
    return dist.all_reduce(t, group=group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, t: torch.Tensor, group: ProcessGroup) -> dist.Work:
    """Start a sum of ``t`` over the group whose rank-th equal piece lands in ``out``; returns the
    handle to ``wait()`` on."""
    _count("reduce_scatter")
    single = getattr(dist, "reduce_scatter_single", None)  # the newer name (torch 2.13)
    return (single or dist.reduce_scatter_tensor)(out, t, group=group, async_op=True)


def all_gather(t: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Concatenate ``t`` from every rank of the group (in group rank order) along ``dim``."""
    if group is None:
        return t
    _count("all_gather")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (the input is already replicated on every tp rank).
    Backward: all-reduce, because each rank's column shard contributes part of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce the partial sums of a row-parallel product.
    Backward: identity (every rank needs the full gradient of the replicated output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None or not torch.is_grad_enabled():
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return x
    if not torch.is_grad_enabled():
        return all_reduce(x, group)  # x is a fresh product: safe to reduce in place
    return _ReduceFromTP.apply(x, group)


def send(t: torch.Tensor, dst: int) -> None:
    """Blocking point-to-point send to global rank ``dst`` (pipeline activations and gradients)."""
    _count("send")
    dist.send(t.contiguous(), dst=dst)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    _count("recv")
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=src)
    return t


def batch_isend_irecv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                      group: ProcessGroup | None = None) -> list[dist.Work]:
    """Post ``(tensor, global peer)`` sends and receives as one batch (default group unless
    ``group`` is given, which must contain the peers).

    Nothing in a batch waits on another part of it (NCCL runs it as one group, gloo posts every
    operation before any wait), so two ranks may send to each other at once. Messages between
    one pair in one direction match in posting order. Counted as ``isend`` / ``irecv``; returns
    the requests to wait on.
    """
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if not ops:
        return []
    for kind, items in (("isend", sends), ("irecv", recvs)):
        for _ in items:
            _count(kind)
    return dist.batch_isend_irecv(ops)


def exchange(sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[tuple[int, ...], torch.dtype, torch.device, int]],
             group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Post every send ``(tensor, dst)`` and receive ``(shape, dtype, device, src)`` together, then
    wait for all of them; returns the received tensors in order.

    Posting both directions at once is what keeps a pipeline schedule deadlock-free: two stages
    that each send to the other before receiving would block forever with ``send``/``recv``.
    """
    received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device, _ in recvs]
    works = batch_isend_irecv([(t.contiguous(), dst) for t, dst in sends],
                              [(t, src) for t, (*_, src) in zip(received, recvs)], group)
    for work in works:
        work.wait()
    return received
