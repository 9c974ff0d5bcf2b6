"""Bytes a rank needs for a model in a layout: weights, gradients, optimizer state, activations,
KV cache. Parameter counts come from the sharding spec, per pipeline stage (the stages holding
the embedding or the LM head are the largest), and a layout is charged its largest rank.

Training keeps bf16 weights, fp32 gradients, fp32 master weights and AdamW moments, as the
training engine does (``Precision``); activations are the bf16 tensors backward needs, per token and layer, with
flash attention (no score matrix) and no sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Union

from shardflow.config.model import ModelConfig
from shardflow.models.token_stats import CHUNK_ELEMENTS
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for, stage_layers
from shardflow.perf.roofline import head_shape, layer_shape


# The token budget picked when the run sets none (``auto_micro_batch_tokens``). Past 32768 tokens
# the training step gets no faster (BENCHMARKS.md, "Training step": the micro-batch budget); the
# share of free memory leaves room for the allocator's fragmentation and what the model misses.
AUTO_MAX_TOKENS = 32768
AUTO_TOKENS_STEP = 1024
AUTO_MEMORY_SHARE = 0.8


class Shape(NamedTuple):
    """A layout without its ranks: all that memory depends on (cheap to make for 1000 ranks)."""

    pp: int
    dp: int
    tp: int


AnyLayout = Union[Layout, Shape]


@dataclass(frozen=True, kw_only=True)
class Precision:
    param_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # gradients accumulate in a float32 buffer (and are all-reduced in it)
    optimizer_bytes: int = 12  # fp32 master weights, AdamW m and v
    activation_bytes: int = 2  # bf16 activations
    logits_bytes: int = 4  # fp32 gradients of the LM head's logits and hidden states
    # an offloaded optimizer's device buffers: two chunks of 2^24 float32 elements of each of its
    # three tensors (engine.train.optimizer.DEFAULT_CHUNK_NUMEL)
    offload_buffer_bytes: int = 2 * 3 * 4 * (1 << 24)

    @property
    def trained_bytes(self) -> int:
        """Per parameter of a trained model at home."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@lru_cache(maxsize=4096)
def rank_params(cfg: ModelConfig, pp: int, tp: int) -> int:
    """Parameters held by the largest rank of any layout with this pp and tp (local shapes,
    vocabulary padding included): a stage's layers, plus the embedding on the first stage and
    the final norm and head on the last (counted off the sharding spec of a two-stage split)."""
    if pp == 1:
        return sum(t.numel() for t in shard_for(cfg, Layout.contiguous(tp=tp), 0).tensors.values())
    two = Layout.contiguous(pp=2, tp=tp)
    ends = [sum(t.numel() for name, t in shard_for(cfg, two, two.rank_at(s, 0, 0)).tensors.items()
                if not name.startswith("model.layers.")) for s in (0, 1)]
    per_layer = layer_shape(cfg, tp).params
    stages = stage_layers(cfg, pp)
    return max(len(layers) * per_layer + (ends[0] if s == 0 else 0) + (ends[1] if s == pp - 1 else 0)
               for s, layers in enumerate(stages))


def stage_layer_count(cfg: ModelConfig, pp: int) -> int:
    """Layers of the longest pipeline stage."""
    return max(len(s) for s in stage_layers(cfg, pp))


def weight_bytes(cfg: ModelConfig, layout: AnyLayout, p: Precision) -> float:
    return rank_params(cfg, layout.pp, layout.tp) * p.param_bytes


def decode_copy_bytes(cfg: ModelConfig, tp: int, p: Precision, transposed: bool) -> float:
    """The copies of its weights a generating rank decodes from on GPUs (``engine.generate.decode_weights``):
    q/k/v and gate/up concatenated; with ``transposed`` also o, down and the LM head (biases left out)."""
    s = layer_shape(cfg, tp)
    per_layer = (s.q_dim + 2 * s.kv_dim + 2 * s.inter) * s.hidden
    head = 0
    if transposed:
        per_layer += (s.q_dim + s.inter) * s.hidden
        head = head_shape(cfg, tp).vocab * s.hidden
    return (cfg.num_layers * per_layer + head) * p.param_bytes


def trained_state_bytes(cfg: ModelConfig, layout: AnyLayout, p: Precision, *, sharded: bool = False,
                        offloaded: bool = False) -> float:
    """Device bytes of a trained model's weights, gradients and optimizer state in its home layout;
    ``sharded``: the optimizer state split over the layout's data-parallel replicas (the gradient
    buffer stays whole: it accumulates over micro-batches); ``offloaded``: the optimizer state in
    host memory, two chunks of it on the device."""
    params = rank_params(cfg, layout.pp, layout.tp)
    if offloaded:
        return params * (p.param_bytes + p.grad_bytes) + p.offload_buffer_bytes
    optimizer = p.optimizer_bytes / layout.dp if sharded else p.optimizer_bytes
    return params * (p.param_bytes + p.grad_bytes + optimizer)


def _stored_per_token_layer(cfg: ModelConfig, tp: int, p: Precision) -> float:
    # Kept for backward, per token and layer: the two residual inputs and two norm outputs (4h),
    # q/k/v after RoPE and the attention output (2q + 2kv), and gate, up, SiLU(gate) and the
    # product fed to down_proj (4 x intermediate), with q/kv/intermediate local to the tp shard.
    s = layer_shape(cfg, tp)
    return (4 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 4 * s.inter) * p.activation_bytes


def _working_per_token_layer(cfg: ModelConfig, tp: int, p: Precision) -> float:
    # Live at once inside one layer's forward: the residual, a norm output, q/k/v, and gate/up
    # with their product.
    s = layer_shape(cfg, tp)
    return (2 * s.hidden + s.q_dim + 2 * s.kv_dim + 3 * s.inter) * p.activation_bytes


def _head_bytes(cfg: ModelConfig, tp: int, tokens: float, p: Precision) -> float:
    # The LM head runs in chunks of vocabulary columns (``models.token_stats``): one chunk's logits
    # and their float32 gradient at a time, whatever the tokens, and per token the float32
    # gradient of its hidden state.
    chunk = min(CHUNK_ELEMENTS, tokens * head_shape(cfg, tp).vocab)
    return chunk * (p.activation_bytes + p.logits_bytes) + tokens * cfg.hidden_size * p.logits_bytes


def train_activation_bytes(cfg: ModelConfig, layout: AnyLayout, tokens_per_micro_batch: float, micro_batches: int,
                           checkpointing: bool, p: Precision) -> float:
    """Peak activations of a rank under 1F1B: the first stage holds up to pp micro-batches in flight."""
    layers = stage_layer_count(cfg, layout.pp)
    in_flight = min(micro_batches, layout.pp)
    tokens = tokens_per_micro_batch
    if checkpointing:  # only each layer's input is kept; one layer is recomputed at a time
        stored = in_flight * tokens * layers * cfg.hidden_size * p.activation_bytes
        stored += tokens * _stored_per_token_layer(cfg, layout.tp, p)
    else:
        stored = in_flight * tokens * layers * _stored_per_token_layer(cfg, layout.tp, p)
    return stored + _head_bytes(cfg, layout.tp, tokens, p)


def inference_activation_bytes(cfg: ModelConfig, layout: AnyLayout, tokens_per_micro_batch: float,
                               p: Precision) -> float:
    """Forward only: one layer's working set and the head's chunk for one micro-batch."""
    tokens = tokens_per_micro_batch
    return tokens * _working_per_token_layer(cfg, layout.tp, p) + _head_bytes(cfg, layout.tp, tokens, p)


def auto_micro_batch_tokens(cfg: ModelConfig, layout: AnyLayout, free_bytes: float, *, training: bool,
                            checkpointing: bool = False, p: Precision = Precision()) -> int:
    """The token budget per micro-batch when the run sets none (``algorithm.micro_batch_tokens``):
    the most tokens, in steps of ``AUTO_TOKENS_STEP``, whose activations (training's under 1F1B, or
    inference's) fit in ``AUTO_MEMORY_SHARE`` of ``free_bytes``, at most ``AUTO_MAX_TOKENS``; at
    least one step (a micro-batch never holds less than its longest sequence anyway)."""
    room = AUTO_MEMORY_SHARE * free_bytes

    def need(tokens: int) -> float:
        if training:
            return train_activation_bytes(cfg, layout, tokens, layout.pp, checkpointing, p)
        return inference_activation_bytes(cfg, layout, tokens, p)

    steps = AUTO_MAX_TOKENS // AUTO_TOKENS_STEP
    lo, hi = 1, steps  # need() grows with tokens: the largest step count that fits, by bisection
    if need(hi * AUTO_TOKENS_STEP) <= room:
        return hi * AUTO_TOKENS_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid * AUTO_TOKENS_STEP) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * AUTO_TOKENS_STEP


def kv_bytes_per_slot(cfg: ModelConfig, tp: int, slot_tokens: int, p: Precision) -> float:
    """One request's KV cache on one tp rank (keys and values, every layer, sized for the longest
    sequence as a static cache is)."""
    return 2 * cfg.num_layers * layer_shape(cfg, tp).kv_dim * slot_tokens * p.activation_bytes


def prefill_activation_bytes(cfg: ModelConfig, tp: int, tokens: float, p: Precision) -> float:
    return tokens * _working_per_token_layer(cfg, tp, p)
