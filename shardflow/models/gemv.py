"""Products of one row by a weight matrix (a batch-1 decode step), without cuBLAS's split-K.

At one row cuBLAS reads the small decode weights well below bandwidth (LLaMA-3.1-8B, H200: q/k/v
at 72%, o at 60% of copy bandwidth) and splits o and down over K, which adds a reduction kernel
and its launch gap per product. ``gemv`` gives each program whole output rows (no split-K, no
reduction kernel); the products accumulate elementwise over the K loop and reduce across threads
once at the end. ``linear`` uses it for one row without autograd on a GPU, and ``F.linear``
everywhere else. Tested on CPU with ``TRITON_INTERPRET=1``.

Shapes: x [1, K] (any leading dims of total size 1), weight [N, K] (nn.Linear's layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path needs no Triton
    triton = None

# Rows per program, K block, warps, stages: the best of a sweep on an H200 over the LLaMA-3.1-8B
# decode products (see BENCHMARKS.md).
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 8, 512, 4, 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, W, Bias, Out, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = W + rows[:, None].to(tl.int64) * stride_wn
        part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            x = tl.load(X + kk, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            part += w.to(tl.float32) * x[None, :]
        y = tl.sum(part, 1)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=mask_n)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES) -> torch.Tensor:
    """x [..., K] with one row in all, @ weight.T (+ bias) -> [..., N]. The keyword options are
    the kernel's tuning knobs (benchmarks sweep them)."""
    if triton is None:
        raise RuntimeError("gemv needs the triton package")
    K = x.shape[-1]
    N = weight.shape[0]
    if x.numel() != K or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row x [..., K] and weight [N, K] contiguous in K; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)} strides {weight.stride()}")
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else x, out, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


# A registered operator, so that torch.compile treats the kernel as one opaque call.
@torch.library.custom_op("shardflow::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemv_triton(x, weight, bias)


@gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the one-row kernel for these operands."""
    return (triton is not None and x.is_cuda and not torch.is_grad_enabled() and x.numel() == x.shape[-1]
            and x.dtype in DTYPES and weight.dtype == x.dtype and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through ``gemv`` for a single row on a GPU outside autograd."""
    return gemv_op(x, weight, bias) if use_gemv(x, weight) else F.linear(x, weight, bias)
