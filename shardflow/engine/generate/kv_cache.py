"""A static KV cache, preallocated from a byte budget, sliceable by KV head.

Per layer of this rank's stage, keys and values are ``[slots + 1, kv_heads_local, max_len,
head_dim]``: one row ("slot") per request being decoded, plus a scratch slot that padding rows of
a CUDA-graph batch write into. Keeping heads on their own dimension means that re-splitting the
cache over a different tp group (adaptive TP) is a slice along dim 1, and a request's whole cache
is ``k[layer][slot, :, :cached_len]``.

``regroup`` views the same memory with fewer heads per slot and proportionally more slots: slot
``s`` holding heads ``[0, K)`` becomes slots ``s * f + j`` holding heads ``[j * K / f, (j + 1) * K / f)``.
A rank whose tensor-parallel group widens by ``f`` keeps its share of every request in place.
"""

from __future__ import annotations

import torch

from shardflow.config.model import ModelConfig
from shardflow.parallel.sharding import RankShard


def bytes_per_slot(shard: RankShard, cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one slot takes on this rank (all layers of its stage)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * len(shard.layers) * shard.num_kv_heads * max_len * cfg.head_dim * item


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [B, kv_heads, T, d] into caches [S, kv_heads, M, d] at rows ``slots`` [B] and
    ``positions`` [B, T]. With ``slots`` [B, N], row b goes into each of its N slots (a prompt's
    samples) in the same write; the values are broadcast, not copied."""
    if slots.dim() == 2:  # prefill only: the decode step's write below stays as compiled and measured
        B, N = slots.shape
        T = positions.shape[1]
        rows, at = slots[:, :, None].expand(B, N, T), positions[:, None].expand(B, N, T)
        k_cache[rows, :, at] = k.transpose(1, 2)[:, None]
        v_cache[rows, :, at] = v.transpose(1, 2)[:, None]
        return
    # Indices on dims 0 and 2 around a slice: the indexed view is [B, T, kv_heads, d].
    rows = slots[:, None].expand_as(positions)
    k_cache[rows, :, positions] = k.transpose(1, 2)
    v_cache[rows, :, positions] = v.transpose(1, 2)


class KVCache:
    def __init__(self, k: dict[int, torch.Tensor], v: dict[int, torch.Tensor]):
        """A cache over existing contiguous tensors [slots + 1, kv_heads, max_len, head_dim] per
        layer; the last slot is the scratch slot. Every slot starts free."""
        first = next(iter(k.values()))
        assert all(t.shape == first.shape and t.is_contiguous() for t in (*k.values(), *v.values()))
        self.k, self.v = k, v
        self.num_slots, self.max_len = first.shape[0] - 1, first.shape[2]
        self._free = list(range(self.num_slots))

    @classmethod
    def zeros(cls, *, layers: tuple[int, ...], num_slots: int, num_kv_heads: int, max_len: int,
              head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        if num_slots < 1:
            raise ValueError(f"a KV cache needs at least one slot, got {num_slots}")
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        # Zero-filled so that reads past a request's length (masked anyway) never see NaNs.
        return cls({i: torch.zeros(shape, dtype=dtype, device=device) for i in layers},
                   {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers})

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
        return cls.zeros(layers=shard.layers, num_slots=slots, num_kv_heads=shard.num_kv_heads, max_len=max_len,
                         head_dim=cfg.head_dim, dtype=dtype, device=device)

    def regroup(self, num_kv_heads: int) -> "KVCache":
        """A new cache over the same memory with ``num_kv_heads`` heads per slot (dividing this
        cache's), every slot free. Data of slot ``s``, heads ``[j * n, (j + 1) * n)`` (n the new head
        count) is slot ``s * f + j`` of the result, f = old heads / n; its scratch slot lies inside
        this cache's scratch slot."""
        first = next(iter(self.k.values()))
        slots1, heads, max_len, head_dim = first.shape  # slots + 1
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"cannot regroup a cache of {heads} KV heads per slot into {num_kv_heads}")
        shape = (slots1 * (heads // num_kv_heads), num_kv_heads, max_len, head_dim)
        return KVCache({i: t.view(shape) for i, t in self.k.items()}, {i: t.view(shape) for i, t in self.v.items()})

    @property
    def num_kv_heads(self) -> int:
        return next(iter(self.k.values())).shape[1]

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

    def release_all(self) -> None:
        """Forget every request (their data stays in memory, e.g. for a regrouped view)."""
        self._free = list(range(self.num_slots))

    def reserve(self, slots: list[int]) -> None:
        """Mark these free slots taken (requests whose data is already in them)."""
        taken = set(slots)
        assert len(taken) == len(slots) and taken <= set(self._free), (slots, self._free)
        self._free = [s for s in self._free if s not in taken]

    # ----- writes --------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, d] of rows ``slots`` [B] (or [B, N]: see ``write_kv``) at
        ``positions`` [B, T]."""
        write_kv(self.k[layer], self.v[layer], slots, positions, k, v)
