"""Log-probability of the target token and entropy, per row of (local) logits, in one pass.

Training reads both from logits of [tokens, vocabulary] (16K x 152K for a Qwen3 micro-batch:
5 GB in bf16). Done with torch ops, each step (upcast, max, exp, sums, softmax kept for backward)
is a pass over that tensor in float32; these Triton kernels read the bf16 logits once forward and
once backward (writing their gradient), keeping only per-row statistics in between.

Vocabulary-parallel: each rank's kernel returns statistics of its own columns relative to its
own row maximum; ``combine`` rescales them to the global maximum and sums them over the tp group
(two all-reduces of [N] and [3, N] floats), the same collectives as the plain torch path.

Per row, with x = logits * scale and m the row maximum: s = sum exp(x - m) and
u = sum exp(x - m) * (x - m). Then log Z = m + log s, log p(target) = x[target] - log Z and the
entropy H = log s - u / s. Backward: d log p(t) / dx = onehot(t) - p, dH / dx = -p * (log p + H).
Padding columns hold -inf and contribute nothing.
"""

from __future__ import annotations

import torch

from shardflow.parallel.comm import ReduceOp, all_reduce

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path serves
    triton = None

BLOCK_V = 2048  # columns per inner step


if triton is not None:

    @triton.jit
    def _stats_kernel(X, Targets, Out, stride_x, V, vocab_start, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        # Per lane: running max (from a finite start, so exp(m_old - m_new) is never nan), sum of
        # exp(x - max), sum of exp(x - max) * (x - max).
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        base = X + row * stride_x
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
            m_new = tl.maximum(m, x)
            alpha = tl.exp(m - m_new)
            e = tl.exp(x - m_new)  # 0 on -inf columns
            d = tl.where(e > 0, x - m_new, 0.0)
            u = (u + (m - m_new) * s) * alpha + e * d
            s = s * alpha + e
            m = m_new
        row_max = tl.max(m, 0)
        alpha = tl.exp(m - row_max)
        s_row = tl.sum(s * alpha, 0)
        u_row = tl.sum((u + (m - row_max) * s) * alpha, 0)
        local = tl.load(Targets + row) - vocab_start
        inside = (local >= 0) & (local < V)
        t = tl.load(base + tl.where(inside, local, 0)).to(tl.float32) * scale
        tl.store(Out + row * 4 + 0, row_max)
        tl.store(Out + row * 4 + 1, s_row)
        tl.store(Out + row * 4 + 2, u_row)
        tl.store(Out + row * 4 + 3, tl.where(inside, t, 0.0))

    @triton.jit
    def _grad_kernel(X, Targets, LogZ, Entropy, GradLp, GradH, G, stride_x, stride_g, V, vocab_start, scale,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        log_z = tl.load(LogZ + row)
        h = tl.load(Entropy + row)
        g_lp = tl.load(GradLp + row)
        g_h = tl.load(GradH + row)
        local = tl.load(Targets + row) - vocab_start
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            mask = cols < V
            x = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32) * scale
            log_p = x - log_z
            p = tl.exp(log_p)
            g = -g_lp * p - g_h * tl.where(p > 0, p * (log_p + h), 0.0)
            g = tl.where(cols == local, g + g_lp, g) * scale
            tl.store(G + row * stride_g + cols, g.to(G.dtype.element_ty), mask=mask)


def local_stats_torch(x: torch.Tensor, targets: torch.Tensor, vocab_start: int, scale: float) -> torch.Tensor:
    """[N, 4] (max, sum exp, sum exp * (x - max), target logit or 0) of x = logits [N, V] * scale."""
    x = x.float() * scale
    # A finite floor: a rank whose columns are all vocabulary padding (-inf) contributes zeros.
    row_max = x.max(dim=-1).values.clamp(min=-1e30)
    shifted = x - row_max[:, None]
    e = shifted.exp()
    local = targets - vocab_start
    inside = (local >= 0) & (local < x.shape[-1])
    t = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]
    return torch.stack([row_max, e.sum(-1), torch.where(e > 0, e * shifted, 0.0).sum(-1),
                        torch.where(inside, t, 0.0)], dim=-1)


def local_stats_triton(x: torch.Tensor, targets: torch.Tensor, vocab_start: int, scale: float) -> torch.Tensor:
    """``local_stats_torch`` in one read of x (GPU, or ``TRITON_INTERPRET=1`` on CPU)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    stats = torch.empty(x.shape[0], 4, dtype=torch.float32, device=x.device)
    _stats_kernel[(x.shape[0],)](x, targets, stats, x.stride(0), x.shape[1], vocab_start, scale, BLOCK=BLOCK_V,
                                 num_warps=8)
    return stats


def grad_torch(x, targets, vocab_start, scale, log_z, entropy, grad_lp, grad_h) -> torch.Tensor:
    """d(sum grad_lp * log p(t) + grad_h * H) / dx for x [N, V] (columns of this rank)."""
    log_p = x.float() * scale - log_z[:, None]
    p = log_p.exp()
    g = -grad_lp[:, None] * p - grad_h[:, None] * torch.where(p > 0, p * (log_p + entropy[:, None]), 0.0)
    local = targets - vocab_start
    inside = (local >= 0) & (local < x.shape[-1])
    g.scatter_add_(-1, local.clamp(0, x.shape[-1] - 1)[:, None], (grad_lp * inside)[:, None])
    return (g * scale).to(x.dtype)


def grad_triton(x, targets, vocab_start, scale, log_z, entropy, grad_lp, grad_h) -> torch.Tensor:
    """``grad_torch`` in one read of x and one write of the gradient."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    g = torch.empty_like(x)
    _grad_kernel[(x.shape[0],)](x, targets, log_z, entropy, grad_lp, grad_h, g, x.stride(0), g.stride(0),
                                x.shape[1], vocab_start, scale, BLOCK=BLOCK_V, num_warps=8)
    return g


def combine(stats: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local [N, 4] statistics -> (log Z, log p(target), entropy), each [N], over the tp group."""
    row_max = stats[:, 0].clone()
    all_reduce(row_max, group, ReduceOp.MAX)
    alpha = torch.exp(stats[:, 0] - row_max)
    s = stats[:, 1] * alpha
    sums = torch.stack([s, (stats[:, 2] + (stats[:, 0] - row_max) * stats[:, 1]) * alpha, stats[:, 3]])
    all_reduce(sums, group)
    log_s = sums[0].log()
    log_z = row_max + log_s
    return log_z, sums[2] - log_z, log_s - sums[1] / sums[0]


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, scale, group):
        stats = (local_stats_triton if _fused(logits) else local_stats_torch)(logits, targets, vocab_start, scale)
        log_z, logprobs, entropy = combine(stats, group)
        ctx.save_for_backward(logits, targets, log_z, entropy)
        ctx.vocab_start, ctx.scale = vocab_start, scale
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, targets, log_z, entropy = ctx.saved_tensors
        grad = grad_triton if _fused(logits) else grad_torch
        g = grad(logits, targets, ctx.vocab_start, ctx.scale, log_z, entropy,
                 grad_lp.float().contiguous(), grad_h.float().contiguous())
        return g, None, None, None, None


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group, *,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), float32 [...], of softmax(logits / temperature) for local logits
    [..., V_local] (vocabulary split over ``group``). Both are differentiable."""
    shape = logits.shape[:-1]
    lp, h = _TokenStats.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).contiguous(),
                              vocab_start, 1.0 / temperature, group)
    return lp.view(shape), h.view(shape)
