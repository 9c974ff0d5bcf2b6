"""The flat float32 gradient buffer: gradients of bf16 parameters summed over micro-batches by the
hooks, in float32."""

from __future__ import annotations

import torch
from torch import nn

from shardflow.engine.train.grad_buffer import GROUP_NUMEL, GradBuffer

# more parameters than a group holds (MAX_SOURCES), one of them large enough to flush a group by itself
SHAPES = [(64, 32), (32,), (GROUP_NUMEL // 1024 + 1, 1024), (32, 16)] + [(16, 16)] * 10


def loss_of(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params[0] + params[1]) @ params[3]
    for p in params[4:]:
        h = h @ p
    return h.float().square().mean() + params[2].float().sin().sum() * 1e-3


def test_micro_batches_sum_in_float32():
    """After three backwards each parameter's slice holds the float32 sum of its three bf16
    gradients (the buffer laid out in reverse registration order)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    inputs = [torch.randn(8, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    params = {f"p{i}": nn.Parameter(w.clone()) for i, w in enumerate(weights)}
    buffer = GradBuffer(params, None, bucket_numel=1 << 20, device=torch.device("cpu"))
    buffer.zero()
    for x in inputs:
        loss_of(list(params.values()), x).backward()
    buffer.finish_reduce()
    buffer.close()

    plain = [w.clone().requires_grad_() for w in weights]
    sums = [torch.zeros(s) for s in SHAPES]
    for x in inputs:
        for total, grad in zip(sums, torch.autograd.grad(loss_of(plain, x), plain)):
            total += grad.float()
    want = torch.cat([t.flatten() for t in reversed(sums)])
    assert buffer.flat.dtype == torch.float32 and want.abs().sum() > 0
    assert torch.equal(buffer.flat[:want.numel()], want)
