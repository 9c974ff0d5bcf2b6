"""Megatron-style tensor-parallel pieces working on local shard tensors.

Column-parallel projections are plain ``nn.Linear`` on the local rows, preceded once per block
by ``copy_to_tp`` (backward all-reduce). Row-parallel projections end with one all-reduce in
forward. The vocabulary is split over tp ranks for the embedding, the LM head and the
log-probabilities, so that full-vocabulary logits never sit on one rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from shardflow.parallel.comm import reduce_from_tp


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local.T) + b``; the bias is replicated and added once."""

    def __init__(self, in_local: int, out: int, bias: bool, group: ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.group = group
        # A product that forward passes without gradients run instead (``engine.generate.decode_weights``).
        self.decode_weight: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decode = self.decode_weight is not None and not torch.is_grad_enabled()
        y = reduce_from_tp(self.decode_weight(x) if decode else F.linear(x, self.weight), self.group)
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
