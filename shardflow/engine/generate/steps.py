"""The two forward passes of generation, through the model's ``attend`` hook.

- ``prefill_logits``: right-padded prompts (or prompt + generated tokens, to recompute a moved
  request's cache) in one forward; keys and values of every position go into the requests' slots,
  attention is plain causal attention over the fresh keys.
- ``decode_logits``: one new token per request; its key and value go into the slot at its
  position, then it attends over the slot's valid positions.

Both return this rank's vocabulary slice of the logits; the model's own tp collectives (two
all-reduces per layer and one for the embedding) are the only communication.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from shardflow.engine.generate.kv_cache import KVCache
from shardflow.models.transformer import Transformer, causal_attention

# attention(q [B,H,d], k_cache, v_cache, slots [B], lengths [B], window, prompts) -> [B,H,d]
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


def decode_logits(model: Transformer, cache: KVCache, attention: DecodeAttention, tokens: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor,
                  prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """tokens, positions, slots [B] -> logits [B, V_local] of the next token. ``prompts``: the
    rows' shared-prompt groups and prompt lengths (see ``decode_attention``), or None.

    Has no host synchronisation and no data-dependent shapes, so it can be captured in a CUDA graph.
    """
    lengths = positions + 1  # valid positions once this token's K/V are written
    windows = model.cfg.sliding_windows

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B,H,1,d], k/v [B,K,1,d]
        cache.write(layer, slots, positions[:, None], k, v)
        out = attention(q[:, :, 0], cache.k[layer], cache.v[layer], slots, lengths, windows[layer], prompts)
        return out[:, :, None]

    hidden = model(tokens[:, None], positions[:, None], attend)  # [B,1,H]
    return model.logits(hidden[:, 0])
