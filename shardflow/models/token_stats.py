"""Log-probability of the target token and entropy from the LM head, without the whole logits.

Training reads both from logits of [tokens, vocabulary] (16K x 152K for a Qwen3 micro-batch:
5 GB in bf16, twice that with its gradient). ``head_logprobs_and_entropy`` runs the head in
chunks of vocabulary columns and keeps only per-row statistics of each (merged as the chunks
come); backward computes each chunk's logits again, except the chunks forward kept where the
device's memory allows (``logits_room``). Done with torch ops, each step (upcast, max,
exp, sums) is a pass over a chunk in float32; the Triton kernels read a bf16 chunk once forward
and once backward (writing its gradient).

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

from shardflow.models.triton_warmup import warmup
from shardflow.parallel.comm import ReduceOp, all_reduce
from shardflow.parallel.device_memory import free_bytes

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import MockTensor  # a dtype and shape standing for a tensor: warm-ups
except ImportError:  # CPU installs: the torch path serves
    triton = None

BLOCK_V = 2048  # columns per inner step


if triton is not None:

    @triton.jit
    def _stats_kernel(X, Targets, Out, stride_x, V, vocab_start, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        # In base-2 units (y = x * log2 e): a running row maximum m, one for the whole block (so
        # that each logit costs one exponential: a maximum per lane would rescale every lane
        # each step, a second exponential per logit), and per lane the sums of 2^(y - m) and of
        # 2^(y - m) * (y - m). m starts finite, so 2^(m_old - m_new) is never nan.
        LOG2E: tl.constexpr = 1.4426950408889634
        LN2: tl.constexpr = 0.6931471805599453
        m = tl.full([], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        base = X + row * stride_x
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            y = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * (scale * LOG2E)
            m_new = tl.maximum(m, tl.max(y, 0))
            alpha = tl.exp2(m - m_new)
            d = y - m_new
            e = tl.exp2(d)  # 0 on -inf columns
            u = (u + (m - m_new) * s) * alpha + e * tl.where(e > 0, d, 0.0)
            s = s * alpha + e
            m = m_new
        local = tl.load(Targets + row) - vocab_start
        inside = (local >= 0) & (local < V)
        t = tl.load(base + tl.where(inside, local, 0)).to(tl.float32) * scale
        tl.store(Out + row * 4 + 0, tl.where(m > -1e30, m * LN2, -1e30))  # all padding: the torch path's floor
        tl.store(Out + row * 4 + 1, tl.sum(s, 0))
        tl.store(Out + row * 4 + 2, tl.sum(u, 0) * LN2)
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
    _launch_stats(_stats_kernel[(x.shape[0],)], x, targets, stats, vocab_start, scale)
    return stats


# The launches' arguments, shared by the launches and by ``warm_kernels`` (whose tensors are
# Triton's stand-ins: a dtype and a shape, so ``stride()`` whole, not ``stride(0)``).
def _launch_stats(kernel, x, targets, stats, vocab_start, scale) -> None:
    kernel(x, targets, stats, x.stride()[0], x.shape[1], vocab_start, scale, BLOCK=BLOCK_V, num_warps=8)


def _launch_grad(kernel, x, targets, log_z, entropy, grad_lp, grad_h, g, vocab_start, scale) -> None:
    kernel(x, targets, log_z, entropy, grad_lp, grad_h, g, x.stride()[0], g.stride()[0], x.shape[1], vocab_start,
           scale, BLOCK=BLOCK_V, num_warps=8)


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
    _launch_grad(_grad_kernel[(x.shape[0],)], x, targets, log_z, entropy, grad_lp, grad_h, g, vocab_start, scale)
    return g


def _rescaled(stats: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[3, N]: the sums of ``stats`` [N, 4] relative to ``row_max`` instead of their own maximum,
    and the target logit."""
    alpha = torch.exp(stats[:, 0] - row_max)
    return torch.stack([stats[:, 1] * alpha, (stats[:, 2] + (stats[:, 0] - row_max) * stats[:, 1]) * alpha,
                        stats[:, 3]])


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The statistics [N, 4] of two disjoint column sets of the same rows, as those of their union."""
    row_max = torch.maximum(a[:, 0], b[:, 0])
    return torch.cat([row_max[None], _rescaled(a, row_max) + _rescaled(b, row_max)]).T.contiguous()


def combine(stats: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local [N, 4] statistics -> (log Z, log p(target), entropy), each [N], over the tp group."""
    row_max = stats[:, 0].clone()
    all_reduce(row_max, group, ReduceOp.MAX)
    sums = _rescaled(stats, row_max)
    all_reduce(sums, group)
    log_s = sums[0].log()
    log_z = row_max + log_s
    return log_z, sums[2] - log_z, log_s - sums[1] / sums[0]


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


CHUNK_ELEMENTS = 1 << 28  # logits per column chunk: 512 MiB in bf16


def chunk_width(rows: int, columns: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Columns per chunk: about ``chunk_elements`` logits (a multiple of 256 columns when wider), at
    most all of them."""
    width = max(1, chunk_elements // max(rows, 1))
    return min(width - width % 256 if width > 256 else width, columns)


def warm_kernels(dtype: torch.dtype, vocab_rows: int, vocab_start: int, rows: int = 16384,
                 chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Compile, without launching, the statistics and gradient kernels for the current CUDA device,
    as training's chunks of ``vocab_rows`` local head rows (from ``vocab_start``) in ``dtype`` will
    launch them: the argument values that Triton specialises on (sizes and offsets divisible by 16
    or not) depend on the chunks' widths, not on the rows (``rows``: any micro-batch's). Returns
    the chunks warmed; each distinct specialisation compiles once (Triton's cache)."""
    width = chunk_width(rows, vocab_rows, chunk_elements)
    chunks = range(0, vocab_rows, width)
    for lo in chunks:
        x = MockTensor(dtype, [1, min(lo + width, vocab_rows) - lo])
        start = vocab_start + lo
        _launch_stats(warmup(_stats_kernel, (1,)), x, torch.int64, torch.float32, start, 1.0)
        _launch_grad(warmup(_grad_kernel, (1,)), x, torch.int64, *[torch.float32] * 4, x,
                     start, 1.0)
    return len(chunks)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, lo: int, hi: int, real_vocab: int) -> torch.Tensor:
    """Logits [N, hi - lo] of local vocabulary rows [lo, hi); rows past ``real_vocab`` (padding) at -inf."""
    logits = hidden @ weight[lo:hi].T
    if real_vocab < hi:
        logits[:, max(real_vocab - lo, 0):] = float("-inf")
    return logits


class _HeadStats(torch.autograd.Function):
    """The LM head and the statistics of its softmax in chunks of vocabulary columns: forward keeps
    per-row statistics (merged over the chunks, then over the tp group) and, where ``keep`` lets
    it, the chunks' logits; backward computes the other chunks' logits again, and from each chunk's
    gradient that chunk's rows of the weight gradient and its share of the hidden states' gradient.
    No [tokens, vocabulary] tensor is made whole; kept chunks are freed as backward uses them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, real_vocab, scale, group, width, keep):
        stats_fn = local_stats_triton if _fused(hidden) else local_stats_torch
        room, stats, kept = keep, None, []
        for lo in range(0, weight.shape[0], width):
            hi = min(lo + width, weight.shape[0])
            logits = _chunk_logits(hidden, weight, lo, hi, real_vocab)
            part = stats_fn(logits, targets, vocab_start + lo, scale)
            stats = part if stats is None else merge(stats, part)
            nbytes = logits.numel() * logits.element_size()
            if room >= nbytes and len(kept) == lo // width:  # the leading chunks, while they fit
                kept.append(logits)
                room -= nbytes
        log_z, logprobs, entropy = combine(stats, group)
        ctx.save_for_backward(hidden, weight, targets, log_z, entropy)
        ctx.vocab_start, ctx.real_vocab, ctx.scale, ctx.width, ctx.kept = vocab_start, real_vocab, scale, width, kept
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        grad_fn = grad_triton if _fused(hidden) else grad_torch
        grad_lp, grad_h = grad_lp.float().contiguous(), grad_h.float().contiguous()
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        kept, ctx.kept = ctx.kept, []
        for i, lo in enumerate(range(0, weight.shape[0], ctx.width)):
            hi = min(lo + ctx.width, weight.shape[0])
            if i < len(kept):
                logits, kept[i] = kept[i], None  # freed once used
            else:
                logits = _chunk_logits(hidden, weight, lo, hi, ctx.real_vocab)
            g = grad_fn(logits, targets, ctx.vocab_start + lo, ctx.scale, log_z, entropy, grad_lp, grad_h)
            del logits
            if grad_weight is not None:
                grad_weight[lo:hi] = g.T @ hidden
            grad_hidden += g @ weight[lo:hi]
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None


def logits_room(hidden: torch.Tensor, weight: torch.Tensor, width: int) -> int:
    """Bytes of chunk logits the head may keep for its backward on ``hidden``'s CUDA device: what
    the device can still give, less what backward takes besides (the float32 gradient of the
    hidden states, the weight's gradient, one chunk's logits and float32 gradient) twice over and
    ``KEEP_MARGIN``. Kept logits are freed before the layers' backward, so they compete only with
    the head's own backward for memory; keeping them spares backward the chunks' products."""
    rows, item = hidden.shape[0], hidden.element_size()
    backward = rows * hidden.shape[1] * 4 + weight.numel() * item + rows * width * (item + 4)
    return max(0, free_bytes(hidden.device) - 2 * backward - KEEP_MARGIN)


KEEP_MARGIN = 2 << 30  # bytes left free past the head's backward (the loss, the allocator's blocks)


def head_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                              real_vocab: int, group, *, temperature: float = 1.0,
                              chunk_elements: int = CHUNK_ELEMENTS,
                              keep_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), float32 [...], of softmax(hidden @ weight.T / temperature) for
    hidden states [..., H] and the local head rows ``weight`` [V_local, H] (vocabulary split over
    ``group``, local rows from ``real_vocab`` on are padding). Both are differentiable, with
    respect to the hidden states and the weight. ``keep_bytes``: at most how many bytes of chunk
    logits forward keeps for backward (the same gradients either way); None: what the device's
    free memory allows (``logits_room``), nothing off CUDA."""
    shape = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    width = chunk_width(flat.shape[0], weight.shape[0], chunk_elements)
    if not (torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)):
        keep_bytes = 0  # no backward to keep them for
    elif keep_bytes is None:
        keep_bytes = logits_room(flat, weight, width) if flat.is_cuda else 0
    lp, h = _HeadStats.apply(flat, weight, targets.reshape(-1).contiguous(), vocab_start, real_vocab,
                             1.0 / temperature, group, width, keep_bytes)
    return lp.view(shape), h.view(shape)
