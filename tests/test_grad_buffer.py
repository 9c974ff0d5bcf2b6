"""The flat float32 gradient buffer: gradients of bf16 parameters summed over micro-batches by the
hooks, in float32; on a GPU the adds run on a stream of their own, with the same sums."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardflow.engine.train.grad_buffer import GROUP_NUMEL, GradBuffer


def accumulated(device: torch.device, overlap: bool, *, micro_batches: int = 3, seed: int = 0) -> torch.Tensor:
    """The buffer after ``micro_batches`` backwards of a small bf16 network (more parameters than a
    group holds, one of them large enough to flush a group by itself), zeroed once before them."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (64, 32), "b": (32,), "c": (GROUP_NUMEL // 1024 + 1, 1024), "d": (32, 16), **{f"e{i}": (16, 16)
                                                                                               for i in range(10)}}
    params = {n: nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16)) for n, s in shapes.items()}
    buffer = GradBuffer(params, None, bucket_numel=1 << 20, device=device, overlap=overlap)
    buffer.zero()
    for _ in range(micro_batches):
        x = torch.randn(8, 64, generator=g).to(device, torch.bfloat16)
        h = torch.tanh(x @ params["a"] + params["b"]) @ params["d"]
        for i in range(10):
            h = h @ params[f"e{i}"]
        loss = h.float().square().mean() + params["c"].float().sin().sum() * 1e-3
        loss.backward()
    buffer.finish_reduce()
    buffer.close()
    return buffer.flat


def test_micro_batches_sum_in_float32():
    """Each parameter's slice holds the float32 sum of its bf16 gradients over the micro-batches."""
    flat = accumulated(torch.device("cpu"), overlap=True)
    g = torch.Generator().manual_seed(0)
    assert flat.dtype == torch.float32 and flat.abs().sum() > 0
    # the same network, its gradients summed by hand
    shapes = [(64, 32), (32,), (GROUP_NUMEL // 1024 + 1, 1024), (32, 16)] + [(16, 16)] * 10
    params = [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in shapes]
    sums = [torch.zeros(s) for s in shapes]
    for _ in range(3):
        x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        h = torch.tanh(x @ params[0] + params[1]) @ params[3]
        for p in params[4:]:
            h = h @ p
        loss = h.float().square().mean() + params[2].float().sin().sum() * 1e-3
        for total, grad in zip(sums, torch.autograd.grad(loss, params)):
            total += grad.float()
    # the buffer's layout: parameters in reverse registration order
    want = torch.cat([t.flatten() for t in reversed(sums)])
    assert torch.equal(flat[:want.numel()], want)


def check_side_stream() -> None:
    """On a GPU the adds on their own stream give the buffer of the adds in backward's, bit for bit."""
    device = torch.device("cuda")
    for seed in range(3):
        assert torch.equal(accumulated(device, overlap=True, seed=seed), accumulated(device, overlap=False, seed=seed))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adds_on_a_side_stream_give_the_same_sums():
    check_side_stream()
