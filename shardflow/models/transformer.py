"""Decoder transformer (LLaMA 2/3/3.1, Mistral, Qwen2, Qwen3) for one rank's shard.

The model holds exactly the tensors the sharding spec gives its rank: the layers of its pipeline
stage, each split over tp. Parameter names are the Hugging Face names, so checkpoints, sharding
and reallocation all agree on them. Communication per layer under tp > 1, forward:
two all-reduces (after attention, after the MLP); backward: two (before attention, before MLP).

Shapes: B batch, T tokens, H hidden, h local query heads, k local KV heads, d head dim,
V local vocabulary rows.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from shardflow.config.model import ModelConfig, RopeConfig
from shardflow.models import compile_settings
from shardflow.models.packed_attention import PackedSequences, packed_attention
from shardflow.models.tensor_parallel import RowParallelLinear, VocabParallelEmbedding
from shardflow.models.token_stats import head_logprobs_and_entropy
from shardflow.parallel.comm import copy_to_tp
from shardflow.parallel.sharding import RankShard

logger = logging.getLogger(__name__)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, per the rope type."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


# A product that forward passes without gradients run instead of the module's own weights: the
# generation engine installs copies laid out for decoding (``engine.generate.decode_weights``).
Product = Callable[[torch.Tensor], torch.Tensor]

# attend(q [B,h,T,d], k [B,k,T,d], v [B,k,T,d]) -> [B,h,T,d], one layer's attention; None means
# plain causal self-attention. It takes no layer index: a compiled layer then serves every layer.
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The same for any layer, its index first: what the generation engine passes to ``forward`` (one
# that reads and writes its KV cache).
LayerAttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# run_layers(layers {index: layer}, h [B,T,H], cos, sin) -> h: a caller's own way of running the stage's layers
RunLayersFn = Callable[[Mapping[str, "DecoderLayer"], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal self-attention over right-padded sequences (padding comes after every real token,
    so a real token never attends to it). ``window``: a token sees at most that many tokens."""
    T = q.shape[2]
    gqa = True if q.shape[1] != k.shape[1] else False  # a bool, not a SymBool, under torch.compile
    if window is None or T <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    i = torch.arange(T, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def warm_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, *,
                   backward: bool) -> None:
    """One small causal attention on ``device`` as the model runs it (its backward too, where
    ``backward``): a process's first one loads the attention library's kernels (on a fresh machine
    about 1 s inside the first prefill, and more inside the first training call), which a thread
    can do while the run sets up. Plans for each real shape are still built at its first use."""
    q, k, v = (torch.zeros(1, n, 64, head_dim, dtype=dtype, device=device, requires_grad=backward)
               for n in (heads, kv_heads, kv_heads))
    out = causal_attention(q, k, v, None)
    if backward:
        out.sum().backward()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard, layer: int, group: ProcessGroup | None):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.group = group
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, d
        self.window = cfg.sliding_windows[layer]
        self.q_proj = nn.Linear(H, shard.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, shard.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, shard.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(shard.num_heads * d, H, cfg.o_bias, group)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.decode_qkv: Product | None = None  # q/k/v in one product, for no-grad forwards

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B,T,H] -> q [B,T,h,d], k and v [B,T,k,d], q and k normed (where the model does) and rotated."""
        B, T, _ = x.shape
        x = copy_to_tp(x, self.group)
        if self.decode_qkv is not None and not torch.is_grad_enabled():
            q, k, v = self.decode_qkv(x).split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                 self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B,T,1,d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[B,T,h,d] attention output -> [B,T,H]."""
        return self.o_proj(out.reshape(*out.shape[:2], self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn | None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))  # [B,heads,T,d]
        out = causal_attention(q, k, v, self.window) if attend is None else attend(q, k, v)
        return self.output(out.transpose(1, 2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard, group: ProcessGroup | None):
        super().__init__()
        H, inter = cfg.hidden_size, shard.intermediate_size
        self.group = group
        self.gate_proj = nn.Linear(H, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, H, cfg.mlp_bias, group)
        self.decode_gate_up: Product | None = None  # gate/up in one product, for no-grad forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        if self.decode_gate_up is not None and not torch.is_grad_enabled():
            gate, up = self.decode_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard, layer: int, group: ProcessGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, layer, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn | None) -> torch.Tensor:
        return self.finish(x + self.self_attn(self.input_layernorm(x), cos, sin, attend))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The layer after its attention's residual: the MLP and its residual."""
        return x + self.mlp(self.post_attention_layernorm(x))


# The two pieces of a layer around its attention, plain functions of the layer so that one compiled
# version serves every layer (their parameters are inputs, not constants).
def _before_attention(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer over its tokens as one row x [1,N,H] up to its attention: q [N,h,d], k and v [N,k,d]."""
    q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    return q[0], k[0], v[0]


def _after_attention(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rest of the layer from its attention's output [N,h,d]."""
    return layer.finish(x + layer.self_attn.output(out[None]))


class LayerRunner:
    """Runs one decoder layer through ``before`` (up to its attention, over the layer's tokens as one
    row), the attention outside any graph (packed: its sizes are host values that change per
    micro-batch; padded rows: causal over each row), then ``after``. Compiled, the two pieces are two
    graphs that serve packed and padded micro-batches of any size alike: a graph break inside one
    compiled layer would make several frames of nested functions, each traced again in every process
    (dynamo's work is not cached), and a graph of the whole layer would specialise on its rows (one
    row against several: compiled again). A caller's ``attend`` (generation's prefill) runs the layer
    eager, whole."""

    def __init__(self, before=_before_attention, after=_after_attention):
        self.before, self.after = before, after

    @classmethod
    def compiled(cls, **options) -> "LayerRunner":
        """The two functions, each through ``torch.compile(fn, **options)``."""
        return cls(*(torch.compile(fn, **options) for fn in (_before_attention, _after_attention)))

    def __call__(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attend: AttendFn | None = None, packed: PackedSequences | None = None) -> torch.Tensor:
        if attend is not None:
            return layer(x, cos, sin, attend)
        B, T, H = x.shape
        row = x.reshape(1, B * T, H)  # the rows' tokens as one row: the projections see tokens, not rows
        cos, sin = (t.expand(B, T, -1).reshape(1, B * T, -1) for t in (cos, sin))  # positions may be shared
        q, k, v = self.before(layer, row, cos, sin)
        if packed is not None:
            out = packed_attention(q, k, v, packed)
        else:
            heads, d = q.shape[1:]
            q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, k, v))  # [B,heads,T,d]
            out = causal_attention(q, k, v, layer.self_attn.window).transpose(1, 2).reshape(B * T, heads, d)
        return self.after(layer, row, out).view(B, T, H)


EAGER_LAYERS = LayerRunner()
TRIAL_TOKENS = 4096  # compile_layers' trial on accelerators: a micro-batch's order of size


class Transformer(nn.Module):
    """One rank's shard: the embedding (first stage), its stage's layers, and the final norm
    with the LM or value head (last stage)."""

    def __init__(self, cfg: ModelConfig, shard: RankShard, tp_group: ProcessGroup | None):
        super().__init__()
        self.cfg, self.shard, self.tp_group = cfg, shard, tp_group
        # Recompute each layer in backward instead of keeping its activations (set by training).
        self.gradient_checkpointing = False
        self._compiled: LayerRunner | None = None  # see compile_layers
        self.model = nn.Module()
        if shard.first_stage:
            self.model.embed_tokens = VocabParallelEmbedding(shard.vocab_size, cfg.hidden_size,
                                                             shard.vocab_start, tp_group)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, shard, i, tp_group) for i in shard.layers})
        self.lm_head = self.score = None
        if shard.last_stage:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.value_head:
                self.score = nn.Linear(cfg.hidden_size, 1, bias=False)
            elif "lm_head.weight" in shard.tensors:
                self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_size, bias=False)
        # Its values are set once the model has storage (``build_model``): computed on the meta
        # device, the rope's arithmetic runs through torch's Python references, which load dynamo.
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.decode_head: Product | None = None  # the LM head's product, for no-grad forwards
        # Real (unpadded) vocabulary rows held here; logits past them are masked to -inf.
        self.real_vocab = max(0, min(shard.vocab_size, cfg.vocab_size - shard.vocab_start))

    # ----- body -------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()  # [B,T,d/2], float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: LayerAttendFn | None = None,
                packed: PackedSequences | None = None, run_layers: RunLayersFn | None = None) -> torch.Tensor:
        """First stage: token ids [B,T]; later stages: hidden states [B,T,H] from the previous
        stage. Returns hidden states [B,T,H], normed on the last stage. ``packed``: the one row
        (B = 1) holds sequences whose attention reads the key tokens it names, instead of causal
        self-attention per row (see ``models.packed_attention``). ``run_layers``: runs the layers
        instead (the generation engine's compiled decode layer)."""
        if packed is not None and (attend is not None or x.shape[0] != 1 or self.has_sliding_windows):
            raise ValueError("packed sequences need one row [1,T], no attend function and full attention "
                             "in every layer")
        h = self.model.embed_tokens(x) if self.shard.first_stage else x
        cos, sin = self.rope(positions, h.dtype)
        if run_layers is not None:
            h = run_layers(self.model.layers, h, cos, sin)
        else:
            h = self._run_layers(h, cos, sin, attend, packed)
        if self.shard.last_stage:
            h = self.model.norm(h)
        return h

    def _run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: LayerAttendFn | None,
                    packed: PackedSequences | None) -> torch.Tensor:
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        run = self.layer_fn(attend)
        for index, layer in self.model.layers.items():
            layer_attend = None if attend is None else functools.partial(attend, int(index))
            if recompute:
                # The decoder has no dropout, so the recomputation needs no saved RNG state. Under
                # tp the recomputed forward repeats its two all-reduces inside backward.
                h = checkpoint(run, layer, h, cos, sin, layer_attend, packed, use_reentrant=False,
                               preserve_rng_state=False)
            else:
                h = run(layer, h, cos, sin, layer_attend, packed)
        return h

    @property
    def has_sliding_windows(self) -> bool:
        return any(w is not None for w in self.cfg.sliding_windows)

    def layer_fn(self, attend: LayerAttendFn | None) -> LayerRunner:
        """What runs one layer: the compiled functions (see ``compile_layers``) for plain causal and
        packed forwards (training, inference); generation passes its own ``attend`` (and compiles its
        decode layer itself, ``engine.generate.steps``)."""
        return self._compiled if attend is None and self._compiled is not None else EAGER_LAYERS

    def compile_layers(self) -> bool:
        """Run padded and packed forwards (and their backwards) of every decoder layer through
        ``torch.compile``d functions (``LayerRunner``), which fuse the norms, rotary embedding and
        activation into few kernels. The compiled code is tried once first; if
        compilation fails the model stays eager and this returns False."""
        compile_settings.apply()
        compiled = LayerRunner.compiled(dynamic=True)
        layer = next(iter(self.model.layers.values()), None)
        if layer is None:
            return False
        p = next(self.parameters())
        # The trial's sizes are the hints of the graph's dynamic sizes, and Triton's kernels are tuned
        # for them: the packed path (one row, its length dynamic) keeps this graph for every micro-batch,
        # and kernels tuned for 4 tokens ran its activation and norms at a third of copy bandwidth on a
        # 15K-token micro-batch. A training-sized trial on accelerators; a small one on the CPU.
        tokens = 4 if p.device.type == "cpu" else TRIAL_TOKENS
        x = torch.zeros(1, tokens, self.cfg.hidden_size, dtype=p.dtype, device=p.device, requires_grad=True)
        cos, sin = self.rope(torch.arange(tokens, device=p.device)[None], p.dtype)
        try:
            q, _, _ = compiled.before(layer, x, cos, sin)
            compiled.after(layer, x, q).sum().backward()  # q stands in for the attention's output
        except Exception as e:  # noqa: BLE001 - any compiler failure: stay eager, say so
            logger.warning(f"torch.compile of the decoder layers failed, running eager: {type(e).__name__}: {e}")
            return False
        finally:
            self.zero_grad(set_to_none=True)
        self._compiled = compiled
        return True

    # ----- heads (last stage) -----------------------------------------------------------

    def head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.cfg.tie_word_embeddings and self.shard.first_stage:
            return self.model.embed_tokens.weight
        raise RuntimeError("this rank holds no LM head (not the last stage, or a value model)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Local vocabulary logits [..., V] (vocabulary padding masked to -inf)."""
        hidden = copy_to_tp(hidden, self.tp_group)
        if self.decode_head is not None and not torch.is_grad_enabled():
            logits = self.decode_head(hidden)
        else:
            logits = F.linear(hidden, self.head_weight())
        if self.real_vocab < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self.real_vocab
            logits = logits.masked_fill(pad, float("-inf"))
        return logits

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(targets) [B,T] under softmax(logits / temperature), computed vocab-parallel."""
        return self.token_stats(hidden, targets, temperature)[0]

    def token_stats(self, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(targets), entropy) [B,T] of softmax(logits / temperature), both differentiable;
        the head runs in chunks of the vocabulary (``models.token_stats``)."""
        return head_logprobs_and_entropy(copy_to_tp(hidden, self.tp_group), self.head_weight(), targets,
                                         self.shard.vocab_start, self.real_vocab, self.tp_group,
                                         temperature=temperature)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scalar per token [B,T] from the value head."""
        if self.score is None:
            raise RuntimeError("this rank holds no value head (not the last stage, or an LM)")
        return self.score(hidden).squeeze(-1)


def build_model(cfg: ModelConfig, shard: RankShard, tp_group: ProcessGroup | None,
                device: torch.device | str, dtype: torch.dtype) -> Transformer:
    """Construct on the meta device, then allocate uninitialised storage on ``device``
    (the caller loads weights or initialises them)."""
    with torch.device("meta"):
        model = Transformer(cfg, shard, tp_group)
    # Each tensor allocated at once in its final dtype: ``to_empty(...).to(dtype)`` would allocate
    # float32 storage first (twice the memory of bf16 weights, for a moment), and its empty_like of
    # meta tensors runs through torch's Python references, which import sympy (a second per process).
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=dtype, device=device)
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
    return model
