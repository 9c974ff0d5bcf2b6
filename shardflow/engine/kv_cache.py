"""A static KV cache, preallocated from a byte budget, sliceable by KV head.

Per layer of this rank's stage, keys and values are ``[slots + 1, kv_heads_local, max_len,
head_dim]``: one row ("slot") per request being decoded, plus a scratch slot that padding rows of
a CUDA-graph batch write into. Keeping heads on their own dimension means that re-splitting the
cache over a different tp group (adaptive TP) is a slice along dim 1, and a request's whole cache
is ``k[layer][slot, :, :cached_len]``.
"""

from __future__ import annotations

import torch

from shardflow.models.config import ModelConfig
from shardflow.parallel.sharding import RankShard


def bytes_per_slot(shard: RankShard, cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one slot takes on this rank (all layers of its stage)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * len(shard.layers) * shard.num_kv_heads * max_len * cfg.head_dim * item


class KVCache:
    def __init__(self, *, layers: tuple[int, ...], num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if num_slots < 1:
            raise ValueError(f"a KV cache needs at least one slot, got {num_slots}")
        self.num_slots, self.max_len = num_slots, max_len
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        # Zero-filled so that reads past a request's length (masked anyway) never see NaNs.
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self._free = list(range(num_slots))

    @classmethod
    def for_model(cls, cfg: ModelConfig, shard: RankShard, *, budget_bytes: int, max_len: int,
                  max_slots: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        """As many slots as ``budget_bytes`` holds (scratch slot included), at most ``max_slots``."""
        per_slot = bytes_per_slot(shard, cfg, max_len, dtype)
        slots = min(max_slots, budget_bytes // per_slot - 1)
        if slots < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no sequence of {max_len} tokens "
                f"({per_slot / 2**20:.1f} MiB per sequence plus one scratch sequence); raise the budget or "
                "lower max_seq_len"
            )
        return cls(layers=shard.layers, num_slots=slots, num_kv_heads=shard.num_kv_heads, max_len=max_len,
                   head_dim=cfg.head_dim, dtype=dtype, device=device)

    # ----- slots ---------------------------------------------------------------------------------

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """The ``n`` lowest free slots (deterministic, so every tp rank picks the same)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV slots with {len(self._free)} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)

    # ----- writes --------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, d] of rows ``slots`` [B] at ``positions`` [B, T]."""
        # Indices on dims 0 and 2 around a slice: the indexed view is [B, T, kv_heads, d].
        rows = slots[:, None].expand_as(positions)
        self.k[layer][rows, :, positions] = k.transpose(1, 2)
        self.v[layer][rows, :, positions] = v.transpose(1, 2)

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slots ``dsts`` (shared prompts)."""
        index = torch.tensor(dsts, device=next(iter(self.k.values())).device)
        for cache in (*self.k.values(), *self.v.values()):
            cache[index, :, :length] = cache[src, :, :length]
