"""Copies of a model's weights that forward passes without gradients (decoding, prefill) read.

The model only has the slots (``Product`` hooks on its attention, MLP, row-parallel projections
and head); the generation engine owns the copies and installs them with ``make_decode_weights``.

Decoding reads every weight once per token, so the layout of each product's weight decides its
speed at small batches:
- q/k/v and gate/up are concatenated, so one product over the concatenation replaces three (or
  two) small ones (made on GPUs always);
- optionally every decode product (q/k/v, o, gate/up, down, LM head) reads its weight stored
  transposed, [in, out] (``x @ w``), for which cuBLAS picks other kernels (faster or not by the
  shape and batch: BENCHMARKS.md). This costs a copy of o, down and the head besides the
  concatenations.

Copies are snapshots: ``refresh`` rewrites them in place after the weights change, so CUDA graphs
captured over them stay valid. Forward passes that record gradients always read the parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardflow.models.transformer import Transformer


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


def _params(*linears: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    biases = [m.bias for m in linears] if linears[0].bias is not None else None
    return [m.weight for m in linears], biases


@torch.no_grad()
def make_decode_weights(model: Transformer, transposed: bool = False) -> None:
    """Install (or refresh in place) the copies that ``model``'s forward passes without gradients
    read: the q/k/v and gate/up weights concatenated, and with ``transposed`` every decode
    product's weight stored [in, out]. Call again after the weights change; CUDA graphs captured
    over the copies stay valid while the layout stays."""
    for layer in model.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.decode_qkv = set_decode_weight(attn.decode_qkv, *_params(attn.q_proj, attn.k_proj, attn.v_proj),
                                            transposed)
        mlp.decode_gate_up = set_decode_weight(mlp.decode_gate_up, *_params(mlp.gate_proj, mlp.up_proj), transposed)
        for row in (attn.o_proj, mlp.down_proj):  # their bias is added after the tp all-reduce
            row.decode_weight = set_decode_weight(row.decode_weight, [row.weight], None, True) if transposed else None
    if model.shard.last_stage and model.score is None:
        model.decode_head = (set_decode_weight(model.decode_head, [model.head_weight()], None, True)
                             if transposed else None)


def refresh_decode_weights(model: Transformer) -> None:
    """Rewrite ``model``'s decode copies from its current weights, in place (a no-op without copies)."""
    layout = decode_weights_layout(model)
    if layout is not None:
        make_decode_weights(model, layout == "transposed")


def drop_decode_weights(model: Transformer) -> None:
    for layer in model.model.layers.values():
        layer.self_attn.decode_qkv = layer.mlp.decode_gate_up = None
        layer.self_attn.o_proj.decode_weight = layer.mlp.down_proj.decode_weight = None
    model.decode_head = None


def decode_weights_layout(model: Transformer) -> str | None:
    """None without decode copies, else "transposed" or "concatenated"."""
    first = next((layer.self_attn.decode_qkv for layer in model.model.layers.values()), None)
    return None if first is None else "transposed" if first.transposed else "concatenated"
