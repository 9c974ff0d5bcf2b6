"""Matrix-vector products of the decode step at small batches, with their neighbours fused in.

At batch 1-8 a decode layer is four weight reads (q/k/v, o, gate/up, down) plus a dozen small
kernels: two RMSNorms with their residual adds, SiLU times up, cuBLAS's split-K reductions. Each
small kernel costs a few microseconds and a launch gap, about a fifth of the step at batch 1.
Here each product reads its weight rows once and does its neighbours' work on the way:

- ``norm``: the input is RMS-normalised first (each program recomputes the row's RMS from the
  input, a few KB read from L2, instead of a separate kernel writing the normed copy);
- ``swiglu``: the weight is gate and up stacked ([2I, K]); each program reads matching gate and
  up rows and writes silu(gate) * up ([M, I]);
- ``residual``: the output is added to a residual ([M, N]) before it is stored.

Rounding follows the unfused torch ops (bf16 after the norm, after each product, after SiLU), so
the fused path agrees with the plain one to bf16 rounding of the same values. Programs split the
output rows only (no split-K), so there is no reduction kernel; each reads BLOCK_N full weight rows.
Tested on CPU with ``TRITON_INTERPRET=1``.

Shapes: M rows (batch), K input features, N outputs, W [N, K] (nn.Linear's layout).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path needs no Triton
    triton = None

MAX_BATCH = 8  # beyond this the products are better done by matrix-multiply kernels
# (rows per program, K block, warps, stages) at batch 1 and batch 2-8 (tensor cores: rows >= 16)
KNOBS_1 = (8, 512, 4, 4)
KNOBS_8 = (32, 256, 4, 4)


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, W, Out, Res, Gamma, Bias, M, N, K, stride_xm, stride_wn, stride_om, stride_rm,
                     up_rows, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = X + offs_m[:, None] * stride_xm
        if NORM:
            squares = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
                x = x.to(tl.float32)
                squares += tl.sum(x * x, 1)
            rstd = tl.rsqrt(squares / K + eps)
        # Batch 1: products accumulate elementwise over the K loop and reduce once at the end (a
        # reduction across threads per step costs more than the step's loads). Batch 2-8: tensor
        # cores on a tile padded to 16 rows (their spare rows cost nothing next to the weight read).
        DOT: tl.constexpr = BLOCK_M > 1
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        part_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if NORM:  # as RMSNorm: normed input rounded to the input dtype, times the weight, rounded
                g = tl.load(Gamma + kk, mask=mask_k, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty)
                x = (x.to(tl.float32) * g[None, :]).to(X.dtype.element_ty)
            w_mask = mask_n[:, None] & mask_k[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
            if SWIGLU:
                u = tl.load(w_rows + up_rows * stride_wn + kk[None, :], mask=w_mask, other=0.0)
            if DOT:
                x = x.to(W.dtype.element_ty)
                if UPCAST:  # Triton's CPU interpreter cannot multiply bf16 tiles
                    x, w = x.to(tl.float32), w.to(tl.float32)
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
                if SWIGLU:
                    if UPCAST:
                        u = u.to(tl.float32)
                    acc_up += tl.dot(x, tl.trans(u), input_precision=PRECISION)
            else:
                part += w.to(tl.float32) * x.to(tl.float32)
                if SWIGLU:
                    part_up += u.to(tl.float32) * x.to(tl.float32)
        if not DOT:
            acc = tl.sum(part, 1)[None, :]
            acc_up = tl.sum(part_up, 1)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(Bias + up_rows + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = acc.to(Out.dtype.element_ty)
        if SWIGLU:
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)
            out = (act.to(tl.float32) * acc_up.to(Out.dtype.element_ty).to(tl.float32)).to(Out.dtype.element_ty)
        mask = mask_m[:, None] & mask_n[None, :]
        if RESIDUAL:
            r = tl.load(Res + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
            out = (r.to(tl.float32) + out.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
         residual: torch.Tensor | None = None, knobs: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), with the options of the module docstring; M <= MAX_BATCH.

    ``norm_weight``: RMSNorm x first (with ``eps``); ``swiglu``: weight is [gate; up] and the result
    silu(x @ gate.T) * (x @ up.T); ``residual`` [M, N]: added to the result. ``knobs``: the
    kernel's (rows per program, K block, warps, stages), for benchmarks to sweep."""
    if triton is None:
        raise RuntimeError("the fused decode products need the triton package")
    M, K = x.shape
    rows = weight.shape[0]
    N = rows // 2 if swiglu else rows
    if M > MAX_BATCH or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [M <= {MAX_BATCH}, K] and weight [N, K], both contiguous in K; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    block_n, block_k, num_warps, num_stages = knobs or (KNOBS_1 if M == 1 else KNOBS_8)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, out, res, norm_weight if norm_weight is not None else x, bias if bias is not None else x,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), N, eps,
        BLOCK_M=1 if M == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm_weight is not None, SWIGLU=swiglu, RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type != "cuda", num_warps=num_warps, num_stages=num_stages,
    )
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused torch ops ``gemv`` stands for (the model's RMSNorm, F.linear, SiLU, add)."""
    if norm_weight is not None:
        h = x.float()
        x = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = torch.nn.functional.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y
