"""The sharding spec: the single source of truth for who holds what.

For a model config and a layout this answers, for every rank, which pipeline stage it is in,
which layers that stage holds, and which slice of each full Hugging Face tensor it holds.
Loading, saving, reallocation, adaptive-TP resharding and the cost model all derive from it.

Every shard is a contiguous range of the full tensor along at most one dimension:

- column-parallel weights (q/k/v, gate/up) split their output rows by head / by column;
- row-parallel weights (o, down) split their input columns the same way;
- vocabulary-parallel embedding and LM head split rows over a vocabulary padded to a multiple
  of lcm(tp, 128) (padding rows are zeros, and their logits are masked to -inf);
- when tp exceeds the number of KV heads, each rank holds one KV head and tp / num_kv_heads
  ranks hold the same one (replication, as serving engines do);
- norms, output biases and the value head are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Coord, Layout

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
VALUE_HEAD = "score.weight"


@dataclass(frozen=True)
class TensorShard:
    """One local tensor: ``local[dim][0 : stop - start] = full[dim][start : stop]``.

    ``dim`` is None for a replicated tensor (then start/stop are unused). Local rows past
    ``stop - start`` (vocabulary padding) are zeros.
    """

    name: str  # parameter name on this rank (the HF name)
    source: str  # checkpoint tensor holding the values (differs only for a tied lm_head)
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    # tp indices whose gradients of this tensor are partial sums of one gradient (q/k norms, and
    # KV projections replicated over tp > num_kv_heads); training sums them. Empty: no such sum.
    partial_grad_tp: tuple[int, ...] = ()

    def full_slices(self) -> tuple[slice, ...]:
        if self.dim is None:
            return tuple(slice(None) for _ in self.full_shape)
        return tuple(slice(self.start, self.stop) if d == self.dim else slice(None) for d in range(len(self.full_shape)))

    def local_slices(self) -> tuple[slice, ...]:
        """Where the full-tensor range lands in the local tensor (excludes padding)."""
        if self.dim is None:
            return tuple(slice(None) for _ in self.local_shape)
        n = self.stop - self.start
        return tuple(slice(0, n) if d == self.dim else slice(None) for d in range(len(self.local_shape)))

    def piece_shape(self) -> tuple[int, ...]:
        """Shape of the full-tensor range held here (the local tensor without padding)."""
        if self.dim is None:
            return self.full_shape
        return tuple(self.stop - self.start if d == self.dim else s for d, s in enumerate(self.full_shape))

    @property
    def padded(self) -> bool:
        return self.dim is not None and self.local_shape[self.dim] != self.stop - self.start

    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n


@dataclass(frozen=True)
class RankShard:
    """Everything one rank holds of one model in one layout."""

    layout: Layout
    rank: int
    coord: Coord
    layers: tuple[int, ...]  # global indices of the decoder layers of this rank's stage
    first_stage: bool  # holds the embedding
    last_stage: bool  # holds the final norm and the LM / value head
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # global index of the first local KV head
    intermediate_size: int  # local MLP width
    vocab_start: int  # first row of the padded vocabulary held here
    vocab_size: int  # local rows (padded vocabulary / tp)
    tensors: dict[str, TensorShard]

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def stage(self) -> int:
        return self.coord.pp


VOCAB_QUANTUM = 128


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """The vocabulary rounded up to a multiple of lcm(tp, 128).

    The same for every power-of-two tp up to 128, so that vocabulary shards nest when adaptive
    TP widens tp in place (and real vocabularies such as 128256 or 151936 need no padding)."""
    quantum = math.lcm(tp, VOCAB_QUANTUM)
    return -(-cfg.vocab_size // quantum) * quantum


def check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Raise ValueError naming the problem if ``cfg`` cannot be split into ``layout``."""
    tp = layout.tp
    if cfg.num_heads % tp:
        raise ValueError(
            f"tp={tp} cannot split {cfg.num_heads} attention heads ({layout}); tp must divide the head count"
        )
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(
            f"tp={tp} cannot split or replicate {cfg.num_kv_heads} KV heads ({layout}); "
            "one must be a multiple of the other"
        )
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} cannot split intermediate_size={cfg.intermediate_size} ({layout})")
    if layout.pp > cfg.num_layers:
        raise ValueError(
            f"pp={layout.pp} exceeds the {cfg.num_layers} layers of the model ({layout}); "
            "every pipeline stage needs at least one layer"
        )


@lru_cache(maxsize=256)
def stage_layers(cfg: ModelConfig, pp: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous layers per pipeline stage, minimising the most expensive stage.

    Cost is matrix FLOPs per token: each layer costs its parameters, and the last stage also pays
    for the LM head (vocab x hidden), which is large for big vocabularies.
    """
    if pp > cfg.num_layers:
        raise ValueError(f"pp={pp} exceeds the {cfg.num_layers} layers of the model")
    n = cfg.num_layers
    layer = cfg.layer_params()
    head = cfg.hidden_size if cfg.value_head else cfg.vocab_size * cfg.hidden_size
    # best[s][i]: (max stage cost, sum of squared stage costs) for layers [0, i) in s stages,
    # minimised in that order: the slowest stage first, then how even the others are.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, pp + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = (i - j) * layer + (head if s == pp and i == n else 0)
                prev_max, prev_sq = best[s - 1][j]
                value = (max(prev_max, cost), prev_sq + cost * cost)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(pp, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(pp))


@lru_cache(maxsize=4096)
def shard_for(cfg: ModelConfig, layout: Layout, rank: int) -> RankShard:
    check_layout(cfg, layout)
    coord = layout.coord(rank)
    tp, t = layout.tp, coord.tp
    layers = stage_layers(cfg, layout.pp)[coord.pp]
    first, last = coord.pp == 0, coord.pp == layout.pp - 1
    h, hd = cfg.hidden_size, cfg.head_dim

    heads = cfg.num_heads // tp
    if tp <= cfg.num_kv_heads:
        kv_heads, kv_start = cfg.num_kv_heads // tp, t * (cfg.num_kv_heads // tp)
        kv_partial: tuple[int, ...] = ()
    else:
        share = tp // cfg.num_kv_heads  # ranks sharing one KV head
        kv_heads, kv_start = 1, t // share
        kv_partial = tuple(range(kv_start * share, (kv_start + 1) * share))
    inter = cfg.intermediate_size // tp
    vocab_local = padded_vocab_size(cfg, tp) // tp
    vocab_start = t * vocab_local

    tensors: dict[str, TensorShard] = {}

    def add(name: str, full: tuple[int, ...], dim: int | None = None, start: int = 0, stop: int = 0,
            local: tuple[int, ...] | None = None, source: str | None = None,
            partial: tuple[int, ...] = ()) -> None:
        if local is None:
            local = full if dim is None else tuple(stop - start if d == dim else s for d, s in enumerate(full))
        tensors[name] = TensorShard(name, source or name, full, local, dim, start, stop, partial)

    def vocab_rows(name: str, source: str | None = None) -> None:
        stop = min(vocab_start + vocab_local, cfg.vocab_size)
        start = min(vocab_start, stop)
        add(name, (cfg.vocab_size, h), 0, start, stop, local=(vocab_local, h), source=source)

    if first:
        vocab_rows(EMBED)
    all_tp = tuple(range(tp)) if tp > 1 else ()
    for i in layers:
        p = f"model.layers.{i}."
        q0, q1 = t * heads * hd, (t + 1) * heads * hd
        k0, k1 = kv_start * hd, (kv_start + kv_heads) * hd
        add(p + "input_layernorm.weight", (h,))
        add(p + "post_attention_layernorm.weight", (h,))
        add(p + "self_attn.q_proj.weight", (cfg.q_size, h), 0, q0, q1)
        add(p + "self_attn.k_proj.weight", (cfg.kv_size, h), 0, k0, k1, partial=kv_partial)
        add(p + "self_attn.v_proj.weight", (cfg.kv_size, h), 0, k0, k1, partial=kv_partial)
        add(p + "self_attn.o_proj.weight", (h, cfg.q_size), 1, q0, q1)
        if cfg.qkv_bias:
            add(p + "self_attn.q_proj.bias", (cfg.q_size,), 0, q0, q1)
            add(p + "self_attn.k_proj.bias", (cfg.kv_size,), 0, k0, k1, partial=kv_partial)
            add(p + "self_attn.v_proj.bias", (cfg.kv_size,), 0, k0, k1, partial=kv_partial)
        if cfg.o_bias:
            add(p + "self_attn.o_proj.bias", (h,))
        if cfg.qk_norm:
            add(p + "self_attn.q_norm.weight", (hd,), partial=all_tp)
            add(p + "self_attn.k_norm.weight", (hd,), partial=all_tp)
        m0, m1 = t * inter, (t + 1) * inter
        add(p + "mlp.gate_proj.weight", (cfg.intermediate_size, h), 0, m0, m1)
        add(p + "mlp.up_proj.weight", (cfg.intermediate_size, h), 0, m0, m1)
        add(p + "mlp.down_proj.weight", (h, cfg.intermediate_size), 1, m0, m1)
        if cfg.mlp_bias:
            add(p + "mlp.gate_proj.bias", (cfg.intermediate_size,), 0, m0, m1)
            add(p + "mlp.up_proj.bias", (cfg.intermediate_size,), 0, m0, m1)
            add(p + "mlp.down_proj.bias", (h,))
    if last:
        add(FINAL_NORM, (h,))
        if cfg.value_head:
            add(VALUE_HEAD, (1, h))
        elif not cfg.tie_word_embeddings:
            vocab_rows(LM_HEAD)
        elif not first:
            # Tied head on its own stage: a copy of the embedding, kept in sync by training.
            vocab_rows(LM_HEAD, source=EMBED)

    return RankShard(
        layout=layout,
        rank=rank,
        coord=coord,
        layers=layers,
        first_stage=first,
        last_stage=last,
        num_heads=heads,
        num_kv_heads=kv_heads,
        kv_head_start=kv_start,
        intermediate_size=inter,
        vocab_start=vocab_start,
        vocab_size=vocab_local,
        tensors=tensors,
    )


@lru_cache(maxsize=4096)
def unique_tensors(cfg: ModelConfig, layout: Layout, rank: int) -> frozenset[str]:
    """Tensors whose local slice this rank counts when every distinct element of one replica's
    model must be counted once (e.g. a gradient norm).

    A slice held by several tp ranks of the stage (replicated norms, KV heads shared when tp
    exceeds the KV heads) counts on the lowest such tp index; a tied head's copy never counts
    (the embedding does).
    """
    mine = shard_for(cfg, layout, rank)
    c = mine.coord
    lower = [shard_for(cfg, layout, layout.rank_at(c.pp, c.dp, t)) for t in range(c.tp)]  # lower tp indices
    unique = set()
    for name, ts in mine.tensors.items():
        if ts.name != ts.source:
            continue
        key = (ts.dim, ts.start, ts.stop)
        if all((p.tensors[name].dim, p.tensors[name].start, p.tensors[name].stop) != key for p in lower):
            unique.add(name)
    return frozenset(unique)


def checkpoint_tensor_names(cfg: ModelConfig) -> list[str]:
    """Names of every tensor a full checkpoint of this model holds, in a stable order."""
    names = list(shard_for(cfg, Layout((0,)), 0).tensors)
    return names
