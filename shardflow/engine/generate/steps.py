"""The two forward passes of generation, through the model's ``attend`` hook.

- ``prefill_logits``: right-padded prompts (or prompt + generated tokens, to recompute a moved
  request's cache) in one forward; keys and values of every position go into the requests' slots,
  attention is plain causal attention over the fresh keys.
- ``extend_cache``: the next tokens of requests whose slots already hold a history (an episode's
  observation after its turn): their keys and values go into the slots after the history, and
  they attend over history and themselves.
- ``decode_logits``: one new token per request; its key and value go into the slot at its
  position, then it attends over the slot's valid positions (through its blocks when the cache
  is paged). ``decode_start``, then layer by layer through ``decode_layer``, then ``decode_end``;
  the engine compiles the three (one layer's code for all of them).

Both return this rank's vocabulary slice of the logits; the model's own tp collectives (two
all-reduces per layer and one for the embedding) are the only communication.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from shardflow.engine.generate.kv_cache import KVCache, write_kv
from shardflow.models.transformer import DecoderLayer, Transformer, causal_attention

# attention(q [B,H,d], k_cache, v_cache, blocks [B] or [B,n], lengths [B], window, prompts) -> [B,H,d]
DecodeAttention = Callable[..., torch.Tensor]


def prefill_logits(model: Transformer, cache: KVCache, ids: torch.Tensor, lengths: torch.Tensor,
                   writes: Sequence[tuple[torch.Tensor | None, torch.Tensor]]) -> torch.Tensor:
    """ids [G,T] right-padded, lengths [G] -> logits [G, V_local] of each last real token. Keys and
    values go to the cache by ``writes``: (rows [R] of the G, or None for all, slots [R, N]), row
    ``rows[r]`` into each of ``slots[r]``, so that the samples of a prompt get its prefill in the
    same write, with no copies afterwards."""
    G, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(G, T)
    windows = model.cfg.sliding_windows

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for rows, slots in writes:  # padding positions too; decode overwrites them
            kv = (k, v) if rows is None else (k[rows], v[rows])
            cache.write(layer, slots, positions[:len(slots)], *kv)
        return causal_attention(q, k, v, windows[layer])

    hidden = model(ids, positions, attend)  # [G,T,H]
    last = hidden[torch.arange(G, device=ids.device), lengths - 1]  # [G,H]
    return model.logits(last)


def extend_cache(model: Transformer, cache: KVCache, ids: torch.Tensor, starts: torch.Tensor,
                 lengths: torch.Tensor, slots: torch.Tensor) -> None:
    """ids [G,T] right-padded: row g's ``lengths[g]`` tokens at positions ``starts[g]`` on, after
    the ``starts[g]`` positions slot ``slots[g]`` holds. Padding writes into the scratch slot."""
    G, T = ids.shape
    t = torch.arange(T, device=ids.device)
    real = t[None, :] < lengths[:, None]  # [G,T]
    positions = starts[:, None] + t[None, :]
    rows = torch.where(real, slots[:, None], cache.scratch_slot)
    at = torch.where(real, positions, t[None, :])
    span = int((starts + lengths).max())
    p = torch.arange(span, device=ids.device)
    ends = (starts + lengths)[:, None, None]
    windows = model.cfg.sliding_windows

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # k/v [G,K,T,d] -> slot rows; then q [G,H,T,d] over the slot's positions [0, start + length)
        write_kv(cache.k[layer], cache.v[layer], *cache.locate(rows, at), k, v)
        keys, values = cache.gather(layer, slots, span)  # [G,K,span,d]
        seen = (p[None, None, :] <= positions[:, :, None]) & (p[None, None, :] < ends)
        if windows[layer] is not None:
            seen &= p[None, None, :] > positions[:, :, None] - windows[layer]
        seen |= ~real[:, :, None] & (p == 0)  # a padding query sees something: no NaN rows
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None],
                                              enable_gqa=q.shape[1] != keys.shape[1])

    model(ids, positions, attend)


def decode_layer(layer: DecoderLayer, x: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, attention: DecodeAttention,
                 at: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, lengths: torch.Tensor,
                 window: int | None, prompts: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode step: the new token's key and value go into the cache at
    ``at`` (blocks, offsets [B,1]), then it attends over its positions. The layer's input is
    ``x + pending`` [B,1,H]: the residual stream and the MLP output of the layer before, which this
    layer adds in the kernel of its input norm (the add alone would be a launch of its own per
    layer). Returns the stream after attention and this layer's MLP output, for the next layer (or
    the final norm) to add. A function of tensors and the layer's module only (no layer index), so
    that one compiled version serves every layer: compilation traces one layer, not the whole stack."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B,H,1,d], k/v [B,K,1,d]
        write_kv(k_cache, v_cache, *at, k, v)
        return attention(q[:, :, 0], k_cache, v_cache, blocks, lengths, window, prompts)[:, :, None]

    x = x + pending
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, attend)
    return x, layer.mlp(layer.post_attention_layernorm(x))


def step_compile_options(mode: str = "default", combo_kernels: bool = True) -> tuple[dict, dict]:
    """``torch.compile``'s arguments for the decode step's functions, and the ones to fall back to:
    inductor's options of ``mode``, with its combo kernels (independent kernels launched as one: a
    layer's query and its key/value write, about 3 us of launch each at a few hundred rows) unless
    turned off; without them as the fallback, should a torch release fail to compile them."""
    options = torch._inductor.list_mode_options(mode)
    return {"options": {**options, "combo_kernels": combo_kernels}}, {"options": {**options, "combo_kernels": False}}


def decode_start(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A decode step before its layers: tokens, positions, slots [B] -> the embedded tokens h
    [B,1,H], what the first layer adds to them (zeros: see ``decode_layer``), the rotary tables
    cos and sin, the rows' blocks (their rows of the block table, or their slots), where the new
    tokens' keys and values go (blocks, offsets [B,1]) and the rows' lengths once they are
    written. A function of tensors and the model, so that the engine can compile it into a few
    kernels (eager, it is about a dozen small ones a step)."""
    h = model.model.embed_tokens(tokens[:, None])
    cos, sin = model.rope(positions[:, None], h.dtype)
    blocks = cache.table[slots] if cache.paged else slots  # [B, n] or [B]
    at = cache.locate(slots[:, None], positions[:, None])
    return h, torch.zeros_like(h), cos, sin, blocks, at, positions + 1


def decode_end(model: Transformer, h: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """A decode step after its layers: the last layer's residual stream h and MLP output
    ``pending`` [B,1,H] -> logits [B, V_local] (the final norm and the head)."""
    return model.logits(model.model.norm(h + pending)[:, 0])


def decode_logits(model: Transformer, cache: KVCache, attention: DecodeAttention, tokens: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor,
                  prompts: tuple[torch.Tensor, torch.Tensor] | None = None,
                  layer_fn: Callable[..., torch.Tensor] = decode_layer, span: int | None = None,
                  start_fn: Callable[..., tuple[torch.Tensor, ...]] = decode_start,
                  end_fn: Callable[..., torch.Tensor] = decode_end) -> torch.Tensor:
    """tokens, positions, slots [B] -> logits [B, V_local] of the next token. ``prompts``: the
    rows' shared-prompt groups and prompt lengths (see ``decode_attention``), or None;
    ``layer_fn``, ``start_fn``, ``end_fn``: ``decode_layer``, ``decode_start`` and ``decode_end``
    or compiled versions of them; ``span``: a host bound on every row's length after this step,
    or None.

    Without ``span`` it has no host synchronisation and no data-dependent shapes, so it can be
    captured in a CUDA graph. With it, attention is handed only the blocks (or, one block per row,
    the positions) that the rows reach: the plain torch attention reads whole rows of what it is
    handed.
    """
    h, pending, cos, sin, blocks, at, lengths = start_fn(model, cache, tokens, positions, slots)
    if span is not None and cache.paged:
        blocks = blocks[:, :-(-span // cache.block_size)]
    upto = span if span is not None and not cache.paged else None
    windows = model.cfg.sliding_windows
    for index, layer in model.model.layers.items():
        k, v = cache.k[int(index)], cache.v[int(index)]
        if upto is not None:
            k, v = k[:, :, :upto], v[:, :, :upto]
        h, pending = layer_fn(layer, h, pending, cos, sin, k, v, attention, at, blocks, lengths, windows[int(index)],
                              prompts)
    return end_fn(model, h, pending)
