"""Pipeline schedules over the stages of one data-parallel replica.

Stage s receives hidden states [B,T,H] from stage s - 1 and sends its own to stage s + 1, by
point-to-point between the ranks of the same dp and tp index (every tp rank of a stage holds
the full, replicated hidden states). In training, gradients of those hidden states flow back the
same way. Every rank of the replica knows the micro-batch shapes, so no shape is ever sent.

Training uses the non-interleaved 1F1B schedule: stage s runs ``pp - s - 1`` warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards. At most
``pp - s`` micro-batches keep activations on stage s. Sends and receives that cross in opposite
directions are posted together (``comm.exchange``), which keeps the schedule deadlock-free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from shardflow.parallel import comm
from shardflow.parallel.layout import Layout

# forward_step(i, x): run micro-batch i on this stage. x is the received hidden state [B,T,H]
# (None on the first stage). Returns the hidden state to send on, or on the last stage the
# scalar loss to backpropagate (training) or anything (inference).
ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor | None]


@dataclass(frozen=True, kw_only=True)
class StageLinks:
    """Where this rank's stage sends and receives, and the activation shapes per micro-batch."""

    prev: int | None  # global rank of the previous stage's peer; None on the first stage
    next: int | None  # global rank of the next stage's peer; None on the last stage
    group: ProcessGroup | None  # the pipeline group holding both peers
    shapes: list[tuple[int, int, int]]  # [B,T,H] of micro-batch i
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, layout: Layout, rank: int, group: ProcessGroup | None, shapes: list[tuple[int, int, int]],
           dtype: torch.dtype, device: torch.device) -> "StageLinks":
        c = layout.coord(rank)
        prev = layout.rank_at(c.pp - 1, c.dp, c.tp) if c.pp > 0 else None
        nxt = layout.rank_at(c.pp + 1, c.dp, c.tp) if c.pp < layout.pp - 1 else None
        return cls(prev=prev, next=nxt, group=group, shapes=shapes, dtype=dtype, device=device)

    def _recv_spec(self, i: int, src: int):
        return (self.shapes[i], self.dtype, self.device, src)

    # Each helper is a no-op at the end of the pipeline it would talk past.

    def recv_forward(self, i: int) -> torch.Tensor | None:
        if self.prev is None:
            return None
        [x] = comm.exchange([], [self._recv_spec(i, self.prev)], self.group)
        return x

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            comm.exchange([(y.detach(), self.next)], [], self.group)

    def send_forward_recv_backward(self, y: torch.Tensor, j: int) -> torch.Tensor | None:
        """Send output i on, receive the gradient of output j."""
        if self.next is None:
            return None
        [g] = comm.exchange([(y.detach(), self.next)], [self._recv_spec(j, self.next)], self.group)
        return g

    def recv_backward(self, j: int) -> torch.Tensor | None:
        if self.next is None:
            return None
        [g] = comm.exchange([], [self._recv_spec(j, self.next)], self.group)
        return g

    def send_backward_recv_forward(self, grad: torch.Tensor | None, i: int) -> torch.Tensor | None:
        """Send the input gradient back, receive input i."""
        if self.prev is None:
            return None
        [x] = comm.exchange([(grad, self.prev)], [self._recv_spec(i, self.prev)], self.group)
        return x

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if self.prev is not None:
            comm.exchange([(grad, self.prev)], [], self.group)


def train_1f1b(links: StageLinks, stage: int, num_stages: int, forward_step: ForwardStep,
               before_backward: Callable[[int], None]) -> None:
    """Forward and backward of every micro-batch on this stage, in 1F1B order.

    ``before_backward(j)`` is called before the backward of micro-batch j (backwards run in
    micro-batch order, so j = count - 1 is the last).
    """
    count = len(links.shapes)
    warmup = min(num_stages - stage - 1, count)
    in_flight: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()  # (input, output)

    def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            x.requires_grad_()
        with record_function("shardflow.forward"):
            return forward_step(i, x)

    def backward(j: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        x, y = in_flight.popleft()
        before_backward(j)
        # Last stage: y is the loss. Otherwise the gradient of y comes from the next stage.
        with record_function("shardflow.backward"):
            torch.autograd.backward(y, grad_out)
        return None if x is None else x.grad

    for i in range(warmup):
        x = links.recv_forward(i)
        y = forward(i, x)
        links.send_forward(y)
        in_flight.append((x, y))

    steady = count - warmup
    x = links.recv_forward(warmup) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        y = forward(i, x)
        grad_out = links.send_forward_recv_backward(y, k)
        in_flight.append((x, y))
        grad_in = backward(k, grad_out)
        if k == steady - 1:
            links.send_backward(grad_in)
        else:
            x = links.send_backward_recv_forward(grad_in, i + 1)

    for j in range(steady, count):
        grad_out = links.recv_backward(j)
        links.send_backward(backward(j, grad_out))


@torch.no_grad()
def forward_only(links: StageLinks, forward_step: ForwardStep) -> None:
    """Every micro-batch through this stage in order (inference): receive, run, send on."""
    for i in range(len(links.shapes)):
        x = links.recv_forward(i)
        with record_function("shardflow.forward"):
            y = forward_step(i, x)
        links.send_forward(y)
