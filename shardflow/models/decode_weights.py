"""Copies of a model's weights that forward passes without gradients (decoding, prefill) read.

Decoding reads every weight once per token, so the layout of each product's weight decides its
speed at small batches:
- q/k/v and gate/up are concatenated, so one product over the concatenation replaces three (or
  two) small ones (made on GPUs always);
- optionally every decode product (q/k/v, o, gate/up, down, LM head) reads its weight stored
  transposed, [in, out] (``x @ w``), for which cuBLAS picks other kernels (on H200 decode steps
  1-3% faster from batch 1 to 256: see BENCHMARKS.md). This costs a copy of o, down and the head
  besides the concatenations.

Copies are snapshots: ``refresh`` rewrites them in place after the weights change, so CUDA graphs
captured over them stay valid. Forward passes that record gradients always read the parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DecodeWeight:
    """One product's weight (several concatenated along the output dimension) and bias."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None, transposed: bool):
        self.transposed = transposed
        self.weight = torch.cat(weights).t().contiguous() if transposed else torch.cat(weights)
        self.bias = torch.cat(biases) if biases else None

    def refresh(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None) -> None:
        """Rewrite the copy from (changed) weights, in place."""
        if self.transposed:
            offset = 0
            for w in weights:
                self.weight[:, offset:offset + w.shape[0]].copy_(w.t())
                offset += w.shape[0]
        else:
            torch.cat(weights, out=self.weight)
        if biases:
            torch.cat(biases, out=self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


def set_decode_weight(old: DecodeWeight | None, weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                      transposed: bool) -> DecodeWeight:
    """``old`` refreshed in place when it has the requested layout, else a new copy."""
    if old is not None and old.transposed == transposed:
        old.refresh(weights, biases)
        return old
    return DecodeWeight(weights, biases, transposed)
