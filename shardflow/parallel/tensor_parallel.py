"""Megatron-style tensor-parallel pieces working on local shard tensors.

Column-parallel projections are plain ``nn.Linear`` on the local rows, preceded once per block
by ``copy_to_tp`` (backward all-reduce). Row-parallel projections end with one all-reduce in
forward. The vocabulary is split over tp ranks for the embedding, the LM head and the
log-probabilities, so that full-vocabulary logits never sit on one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from shardflow.parallel.comm import all_reduce, reduce_from_tp


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local.T) + b``; the bias is replicated and added once."""

    def __init__(self, in_local: int, out: int, bias: bool, group: ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + local) of the (padded) embedding; one all-reduce."""

    def __init__(self, local_vocab: int, hidden: int, vocab_start: int, group: ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_vocab, hidden))
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] with the vocabulary split over tp ranks.

    Forward: three all-reduces of [N] floats (max, sum of exp, target logit).
    Backward: none; each rank's gradient is (onehot - softmax) restricted to its columns.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                group: ProcessGroup | None) -> torch.Tensor:
        x = logits.float()
        row_max = x.max(dim=-1).values
        all_reduce(row_max, group, ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        local = targets - vocab_start
        inside = (local >= 0) & (local < x.shape[-1])
        local = local.masked_fill(~inside, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        all_reduce(target_logit, group)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, inside)
        ctx.logits_dtype = logits.dtype
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.mul_(-grad.unsqueeze(-1))
        g.scatter_add_(-1, local.unsqueeze(-1), (grad * inside).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                            group: ProcessGroup | None) -> torch.Tensor:
    """Log-probabilities [...] of ``targets`` [...] under local ``logits`` [..., V_local]."""
    return _VocabParallelLogprobs.apply(logits, targets, vocab_start, group)


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) with the vocabulary split over tp ranks.

    Forward: two all-reduces ([N] max, then [2, N] sums). Backward: none; with p = softmax and
    H the entropy, dH/dx = -p * (log p + H), which each rank evaluates on its own columns. Only
    the logits and three [N] statistics are saved; the softmax is recomputed in backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        x = logits.float()
        row_max = x.max(dim=-1).values
        all_reduce(row_max, group, ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        exp = x.exp()
        # H = log Z - E[x]; padded columns hold -inf logits: exp is 0 there, and 0 * -inf is masked.
        sums = torch.stack([exp.sum(-1), torch.where(exp > 0, exp * x, 0.0).sum(-1)])
        all_reduce(sums, group)
        log_z = sums[0].log()
        entropy = log_z - sums[1] / sums[0]
        ctx.save_for_backward(logits, row_max, log_z, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, row_max, log_z, entropy = ctx.saved_tensors
        log_p = logits.float() - (row_max + log_z).unsqueeze(-1)  # [..., V_local]
        p = log_p.exp()
        g = torch.where(p > 0, -p * (log_p + entropy.unsqueeze(-1)), 0.0) * grad.unsqueeze(-1)
        return g.to(logits.dtype), None


def vocab_parallel_entropy(logits: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Entropy [...] of softmax(logits) with the vocabulary split over tp (differentiable)."""
    return _VocabParallelEntropy.apply(logits, group)
