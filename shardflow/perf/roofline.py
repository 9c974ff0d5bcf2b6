"""Roofline estimates of one GPU's share of a layer: FLOPs and bytes against measured rates.

Used for hardware or shapes that were not profiled. A pass is modelled as separate kernels that
do not overlap: the GEMMs (bound by FLOPs or by reading the weights), attention (FLOPs or reading
the KV cache) and elementwise work (norms, RoPE, SiLU, residuals: bound by HBM traffic), plus a
fixed launch overhead per layer. Sizes are those of one tensor-parallel shard, taken from the
sharding spec (``shard_for``), so KV heads replicated over tp > num_kv_heads are counted right.
Token and batch counts may be numpy arrays (the adaptive-TP policy asks for many points at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for
from shardflow.perf.hardware import Cluster


def _max(a, b):
    """The larger cost; element by element when either is an array."""
    return np.maximum(a, b) if np.ndim(a) or np.ndim(b) else max(a, b)


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as one tp rank holds it (local sizes)."""

    hidden: int
    q_dim: int  # local query heads x head_dim
    kv_dim: int  # local KV heads x head_dim
    inter: int  # local MLP width
    params: int  # local parameters of the layer


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    vocab: int  # local (padded) vocabulary rows; 1 for a value head
    value_head: bool


@lru_cache(maxsize=512)
def layer_shape(cfg: ModelConfig, tp: int) -> LayerShape:
    shard = shard_for(cfg, Layout.contiguous(tp=tp), 0)
    prefix = f"model.layers.{shard.layers[0]}."
    params = sum(t.numel() for name, t in shard.tensors.items() if name.startswith(prefix))
    return LayerShape(hidden=cfg.hidden_size, q_dim=shard.num_heads * cfg.head_dim,
                      kv_dim=shard.num_kv_heads * cfg.head_dim, inter=shard.intermediate_size, params=params)


@lru_cache(maxsize=512)
def head_shape(cfg: ModelConfig, tp: int) -> HeadShape:
    shard = shard_for(cfg, Layout.contiguous(tp=tp), 0)
    return HeadShape(hidden=cfg.hidden_size, vocab=1 if cfg.value_head else shard.vocab_size,
                     value_head=cfg.value_head)


@dataclass(frozen=True, kw_only=True)
class Roofline:
    matmul_efficiency: float = 0.8  # layer GEMMs reach this fraction of the measured GEMM rate
    attention_efficiency: float = 0.5  # flash attention against the same rate
    dtype_bytes: int = 2  # bf16 weights and activations
    # AdamW over fp32 master weights: read the fp32 gradient, master, m and v; write master, m, v
    # and the bf16 parameter.
    optimizer_bytes_per_param: float = 4 + 3 * 4 + 3 * 4 + 2
    # each micro-batch's bf16 weight gradient added into the float32 buffer: read it, read and
    # write the buffer (``engine.train.grad_accumulate``)
    grad_accumulate_bytes_per_param: float = 2 + 4 + 4

    # ----- decoder layer ---------------------------------------------------------------------

    def _elementwise_elems(self, s: LayerShape) -> int:
        # per token: two norms, RoPE on q/k, SiLU*up, two residual adds, and the activations each
        # GEMM reads and writes (one read and one write each)
        return 15 * s.hidden + 6 * s.q_dim + 8 * s.kv_dim + 6 * s.inter

    def layer_forward(self, s: LayerShape, c: Cluster, tokens: float, seqlen: float) -> float:
        """Forward of ``tokens`` tokens in sequences of ``seqlen`` (causal attention)."""
        gemm = _max(2 * tokens * s.params / (c.matmul_flops * self.matmul_efficiency),
                   s.params * self.dtype_bytes / c.hbm_bandwidth)
        elem = tokens * self._elementwise_elems(s) * self.dtype_bytes / c.hbm_bandwidth
        return gemm + self.attention_forward(s, c, tokens, seqlen) + elem + c.layer_overhead_s

    def layer_backward(self, s: LayerShape, c: Cluster, tokens: float, seqlen: float) -> float:
        """Backward (input and weight gradients): twice the GEMM FLOPs, 2.5x attention."""
        gemm = _max(4 * tokens * s.params / (c.matmul_flops * self.matmul_efficiency),
                   2 * s.params * self.dtype_bytes / c.hbm_bandwidth)
        elem = 2 * tokens * self._elementwise_elems(s) * self.dtype_bytes / c.hbm_bandwidth
        return gemm + self.attention_backward(s, c, tokens, seqlen) + elem + 2 * c.layer_overhead_s

    def attention_forward(self, s: LayerShape, c: Cluster, tokens: float, seqlen: float) -> float:
        """Causal attention of ``tokens`` tokens in sequences of ``seqlen`` (part of ``layer_forward``)."""
        return 2 * tokens * seqlen * s.q_dim / (c.matmul_flops * self.attention_efficiency)

    def attention_backward(self, s: LayerShape, c: Cluster, tokens: float, seqlen: float) -> float:
        return 2.5 * self.attention_forward(s, c, tokens, seqlen)

    def _packing_bytes(self, s: LayerShape, slots: float) -> float:
        # q, k and v gathered into the rows' slots (read and written), each query's output taken back
        return slots * 2 * (2 * s.q_dim + 2 * s.kv_dim) * self.dtype_bytes

    def packed_forward(self, s: LayerShape, c: Cluster, slots: float, seqlen: float) -> float:
        """Attention over packed tokens in rows of ``slots`` key slots of length ``seqlen``
        (``models.packed_attention``'s rows kernel): the rows' causal attention and the gathers."""
        return self.attention_forward(s, c, slots, seqlen) + self._packing_bytes(s, slots) / c.hbm_bandwidth

    def packed_backward(self, s: LayerShape, c: Cluster, slots: float, seqlen: float) -> float:
        return self.attention_backward(s, c, slots, seqlen) + self._packing_bytes(s, slots) / c.hbm_bandwidth

    def decode_layer(self, s: LayerShape, c: Cluster, batch: float, context: float) -> float:
        """One decode step of ``batch`` requests whose KV caches hold ``context`` tokens."""
        gemm = _max(2 * batch * s.params / (c.matmul_flops * self.matmul_efficiency),
                   s.params * self.dtype_bytes / c.hbm_bandwidth)
        kv_bytes = 2 * batch * context * s.kv_dim * self.dtype_bytes
        attn = _max(4 * batch * context * s.q_dim / (c.matmul_flops * self.attention_efficiency),
                   kv_bytes / c.hbm_bandwidth)
        elem = batch * self._elementwise_elems(s) * self.dtype_bytes / c.hbm_bandwidth
        return gemm + attn + elem + c.layer_overhead_s

    # ----- final norm and head ----------------------------------------------------------------

    def head_forward(self, s: HeadShape, c: Cluster, tokens: float) -> float:
        """Final norm, LM head and per-token log-probabilities (fp32 logits, read three times)."""
        params = s.hidden * s.vocab
        gemm = _max(2 * tokens * params / (c.matmul_flops * self.matmul_efficiency),
                   params * self.dtype_bytes / c.hbm_bandwidth)
        elem = tokens * (4 * s.hidden * self.dtype_bytes + 3 * 4 * s.vocab) / c.hbm_bandwidth
        return gemm + elem + c.layer_overhead_s

    def head_backward(self, s: HeadShape, c: Cluster, tokens: float) -> float:
        """The head's two gradient products and its logits computed again: the head runs in chunks
        of the vocabulary and keeps a chunk's logits for backward only where the device's free
        memory allows at run time (``models.token_stats.logits_room``), so this charges the
        recompute; a measured profile times whatever the profiling device kept."""
        params = s.hidden * s.vocab
        gemm = _max(6 * tokens * params / (c.matmul_flops * self.matmul_efficiency),
                   3 * params * self.dtype_bytes / c.hbm_bandwidth)
        elem = tokens * (4 * s.hidden * self.dtype_bytes + 3 * 4 * s.vocab) / c.hbm_bandwidth
        return gemm + elem + c.layer_overhead_s

    def optimizer(self, c: Cluster, params: float) -> float:
        return params * self.optimizer_bytes_per_param / c.hbm_bandwidth

    def grad_accumulate(self, c: Cluster, params: float) -> float:
        return params * self.grad_accumulate_bytes_per_param / c.hbm_bandwidth
