"""The KV cache: blocks of keys and values, and a block table per request slot.

Per layer of this rank's stage, keys and values are ``[blocks + 1, kv_heads_local, block_size,
head_dim]``; the last block is a scratch block that padding rows and padding positions write into.
A *slot* is one request being decoded: row ``s`` of the block table ``table`` [slots + 1, max_len /
block_size] names the blocks holding its positions, position ``p`` at ``(table[s, p // block_size],
p % block_size)``; the last row is the scratch slot (all scratch block). Entries a request has not
been given yet point at the scratch block too, so a write past its blocks never lands in another's.

Two ways to lay it out, one code path:

- **contiguous** (``block_size`` = max_len): one block per slot, block ``s`` for slot ``s`` for
  ever. Every slot reserves ``max_len``; nothing is allocated while decoding.
- **paged** (``block_size`` < max_len): blocks are handed out as requests grow (``ensure``) and
  return when they end, so the cache holds live tokens; the full blocks of a prompt are shared by
  all its samples (``share``, reference-counted). When ``ensure`` finds too few free blocks the
  engine preempts requests (their KV is dropped and recomputed when they are admitted again).

Decisions depend only on host data that every tp rank holds identically (lowest free block first),
so the ranks of a replica keep identical tables. Heads keep their own dimension: re-splitting the
cache over a different tp group (adaptive TP) is a slice along dim 1, and ``regroup`` views the
same memory with fewer heads per block and proportionally more blocks (and slots).
"""

from __future__ import annotations

import math

import torch

from shardflow.config.experiment import KV_BLOCK_MULTIPLE
from shardflow.config.model import ModelConfig
from shardflow.parallel.sharding import RankShard


def bytes_per_position(shard: RankShard, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token position takes on this rank (all layers of its stage)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * len(shard.layers) * shard.num_kv_heads * cfg.head_dim * item


def bytes_per_slot(shard: RankShard, cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one contiguous slot of ``max_len`` positions takes on this rank."""
    return bytes_per_position(shard, cfg, dtype) * max_len


def block_layout(max_len: int, block_size: int | None) -> tuple[int, int]:
    """(positions per block, blocks per slot) of ``KVCache.for_model``'s cache: paged where
    ``block_size`` is set and under ``max_len``, else one contiguous block of ``max_len`` per slot."""
    if block_size is not None and block_size < max_len:
        return block_size, math.ceil(max_len / block_size)
    return max_len, 1


def check_block_size(block_size: int | None) -> None:
    if block_size is not None and (block_size < KV_BLOCK_MULTIPLE or block_size % KV_BLOCK_MULTIPLE):
        raise ValueError(f"kv_block_size must be a positive multiple of {KV_BLOCK_MULTIPLE} tokens (or None for one "
                         f"contiguous block per slot); got {block_size}")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, at: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k, v [B, kv_heads, T, d] into caches [S, kv_heads, N, d] at blocks and offsets [B, T]
    (in a contiguous cache: slots and positions)."""
    # Indices on dims 0 and 2 around a slice: the indexed view is [B, T, kv_heads, d].
    k_cache[blocks, :, at] = k.transpose(1, 2)
    v_cache[blocks, :, at] = v.transpose(1, 2)


class KVCache:
    def __init__(self, k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], *, num_slots: int | None = None,
                 max_len: int | None = None):
        """A cache over existing tensors [blocks + 1, kv_heads, block_size, head_dim] per layer, the
        last block the scratch block. Without ``num_slots`` it is contiguous (one block per slot, of
        ``block_size`` = max_len positions); with it, paged: ``num_slots`` block-table rows of
        ``max_len`` positions. Every slot and block starts free."""
        first = next(iter(k.values()))
        assert all(t.shape == first.shape and t.is_contiguous() for t in (*k.values(), *v.values()))
        self.k, self.v = k, v
        self.num_blocks, self.block_size = first.shape[0] - 1, first.shape[2]
        self.paged = num_slots is not None
        self.num_slots = num_slots if self.paged else self.num_blocks
        self.max_len = max_len if self.paged else self.block_size
        self.blocks_per_slot = math.ceil(self.max_len / self.block_size)
        if self.paged and self.num_blocks < self.blocks_per_slot:
            raise ValueError(f"a paged KV cache of {self.num_blocks} blocks of {self.block_size} tokens cannot hold "
                             f"one sequence of {self.max_len} tokens; raise the budget or lower max_seq_len")
        self._free = list(range(self.num_slots))
        if self.paged:
            table = torch.full((self.num_slots + 1, self.blocks_per_slot), self.scratch_block, dtype=torch.int64)
            self._blocks: list[list[int]] = [[] for _ in range(self.num_slots)]
            self._refs = [0] * self.num_blocks
            self._free_blocks = list(range(self.num_blocks))
        else:
            table = torch.arange(self.num_slots + 1, dtype=torch.int64)[:, None]
        self.table = table.to(first.device)  # read by the decode step (a CUDA graph reads it in place)

    @classmethod
    def zeros(cls, *, layers: tuple[int, ...], num_slots: int, num_kv_heads: int, max_len: int,
              head_dim: int, dtype: torch.dtype, device: torch.device | str, block_size: int | None = None,
              num_blocks: int | None = None) -> "KVCache":
        """Contiguous (``block_size`` None: ``num_slots`` blocks of ``max_len``) or paged."""
        if num_slots < 1:
            raise ValueError(f"a KV cache needs at least one slot, got {num_slots}")
        paged = block_size is not None
        shape = (num_blocks if paged else num_slots) + 1, num_kv_heads, block_size or max_len, head_dim
        # Zero-filled so that reads past a request's length (masked anyway) never see NaNs.
        k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        return cls(k, v, num_slots=num_slots, max_len=max_len) if paged else cls(k, v)

    @classmethod
    def for_model(cls, cfg: ModelConfig, shard: RankShard, *, budget_bytes: int, max_len: int,
                  max_slots: int, dtype: torch.dtype, device: torch.device | str,
                  block_size: int | None = None) -> "KVCache":
        """Contiguous: as many slots as ``budget_bytes`` holds (scratch slot included), at most
        ``max_slots``. Paged: ``max_slots`` slots over as many blocks as the budget holds (at most
        enough for every slot at ``max_len``)."""
        check_block_size(block_size)
        per_position = bytes_per_position(shard, cfg, dtype)
        common = dict(layers=shard.layers, num_kv_heads=shard.num_kv_heads, max_len=max_len,
                      head_dim=cfg.head_dim, dtype=dtype, device=device)
        positions, per_slot = block_layout(max_len, block_size)
        if positions < max_len:  # paged
            blocks = min(max_slots * per_slot, budget_bytes // (per_position * block_size) - 1)
            if blocks < per_slot:
                raise ValueError(
                    f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds {max(blocks, 0)} blocks of "
                    f"{block_size} tokens, fewer than one sequence of {max_len} tokens needs ({per_slot}, plus a "
                    "scratch block); raise the budget or lower max_seq_len")
            return cls.zeros(num_slots=max_slots, block_size=block_size, num_blocks=blocks, **common)
        per_slot = per_position * max_len
        slots = min(max_slots, budget_bytes // per_slot - 1)
        if slots < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds no sequence of {max_len} tokens "
                f"({per_slot / 2**20:.1f} MiB per sequence plus one scratch sequence); raise the budget or "
                "lower max_seq_len"
            )
        return cls.zeros(num_slots=slots, **common)

    def regroup(self, num_kv_heads: int) -> "KVCache":
        """A new cache over the same memory with ``num_kv_heads`` heads per block (dividing this
        cache's), every slot and block free. Data of block ``b``, heads ``[j * n, (j + 1) * n)`` (n
        the new head count) is block ``b * f + j`` of the result, f = old heads / n; its scratch
        block lies inside this cache's scratch block. A contiguous cache's blocks are its slots; a
        paged one gets ``(slots + 1) * f - 1`` slots (as many as a contiguous one would)."""
        first = next(iter(self.k.values()))
        blocks1, heads, block_size, head_dim = first.shape  # blocks + 1
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"cannot regroup a cache of {heads} KV heads per slot into {num_kv_heads}")
        f = heads // num_kv_heads
        shape = (blocks1 * f, num_kv_heads, block_size, head_dim)
        k, v = {i: t.view(shape) for i, t in self.k.items()}, {i: t.view(shape) for i, t in self.v.items()}
        if not self.paged:
            return KVCache(k, v)
        return KVCache(k, v, num_slots=(self.num_slots + 1) * f - 1, max_len=self.max_len)

    @property
    def num_kv_heads(self) -> int:
        return next(iter(self.k.values())).shape[1]

    # ----- slots ---------------------------------------------------------------------------------

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """The ``n`` lowest free slots (deterministic, so every tp rank picks the same). A paged
        slot holds no blocks yet (``ensure``, ``share``)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV slots with {len(self._free)} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def release(self, slot: int) -> None:
        """Free the slot and (paged) its blocks that no other slot shares."""
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)
        if self.paged and self._blocks[slot]:
            for b in self._blocks[slot]:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self._free_blocks.append(b)
            self._blocks[slot] = []
            self.table[slot].fill_(self.scratch_block)

    def release_all(self) -> None:
        """Forget every request (their data stays in memory, e.g. for a regrouped view)."""
        self._free = list(range(self.num_slots))
        if self.paged:
            self._blocks = [[] for _ in range(self.num_slots)]
            self._refs = [0] * self.num_blocks
            self._free_blocks = list(range(self.num_blocks))
            self.table.fill_(self.scratch_block)

    def reserve(self, slots: list[int]) -> None:
        """Mark these free slots taken (requests whose data is already in them; a paged slot then
        gets its blocks by ``assign``)."""
        taken = set(slots)
        assert len(taken) == len(slots) and taken <= set(self._free), (slots, self._free)
        self._free = [s for s in self._free if s not in taken]

    # ----- blocks (paged) ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any slot (a contiguous cache: its free slots' blocks)."""
        return len(self._free_blocks) if self.paged else len(self._free)

    def blocks_for(self, length: int) -> int:
        """Blocks that ``length`` positions take."""
        return math.ceil(length / self.block_size)

    def blocks_missing(self, slot: int, length: int) -> int:
        """Blocks slot ``slot`` lacks to hold ``length`` positions (0 in a contiguous cache)."""
        return max(0, self.blocks_for(min(length, self.max_len)) - len(self._blocks[slot])) if self.paged else 0

    def ensure(self, slots: list[int], lengths: list[int]) -> bool:
        """Give each slot the blocks it lacks to hold its length (capped at max_len), lowest free
        first, all or none: False (nothing changed) if too few blocks are free."""
        if not self.paged:
            return True
        missing = [self.blocks_missing(s, n) for s, n in zip(slots, lengths)]
        if sum(missing) > len(self._free_blocks):
            return False
        self._free_blocks.sort()
        rows, cols, new = [], [], []
        for s, m in zip(slots, missing):
            for _ in range(m):
                b = self._free_blocks.pop(0)
                rows.append(s)
                cols.append(len(self._blocks[s]))
                new.append(b)
                self._blocks[s].append(b)
                self._refs[b] = 1
        if new:
            self._set_table(rows, cols, new)
        return True

    def _set_table(self, rows: list[int], cols: list[int], blocks: list[int]) -> None:
        """table[rows[i], cols[i]] = blocks[i], without the host waiting for the device: the
        engine launches a decode step before it reads the last one back, and rows cross into new
        blocks at most steps."""
        update = torch.tensor([rows, cols, blocks], dtype=torch.int64)
        if self.table.device.type == "cuda":
            update = update.pin_memory().to(self.table.device, non_blocking=True)
        self.table[update[0], update[1]] = update[2]

    def share(self, source: int, slots: list[int], length: int) -> None:
        """Slots holding no blocks yet take ``source``'s blocks of the whole blocks within its first
        ``length`` positions (a prompt's samples: the partial last block stays each one's own, as
        their responses go on in it). A no-op in a contiguous cache."""
        if not self.paged:
            return
        shared = self._blocks[source][: length // self.block_size]
        for s in slots:
            assert not self._blocks[s], s
            self._blocks[s] = list(shared)
            for b in shared:
                self._refs[b] += 1
            if shared:
                self.table[s, : len(shared)] = self.table[source, : len(shared)]

    def blocks_of(self, slot: int) -> list[int]:
        return list(self._blocks[slot]) if self.paged else [slot]

    def assign(self, slot: int, blocks: list[int]) -> None:
        """A taken paged slot with no blocks holds these, in order (data already in them, or about
        to be written); blocks other slots hold are shared."""
        assert self.paged and not self._blocks[slot] and len(blocks) <= self.blocks_per_slot, (slot, blocks)
        for b in blocks:
            if self._refs[b] == 0:
                self._free_blocks.remove(b)
            self._refs[b] += 1
        self._blocks[slot] = list(blocks)
        if blocks:
            self._set_table([slot] * len(blocks), list(range(len(blocks))), list(blocks))

    def clean_blocks(self, factor: int, held: list[int]) -> list[int]:
        """Blocks of this view (``regroup`` by ``factor`` of another) outside every block of the
        other's that ``held`` lists: they hold nothing still to be read."""
        dirty = {b * factor + j for b in held for j in range(factor)}
        return [b for b in range(self.num_blocks) if b not in dirty]

    # ----- reads and writes ----------------------------------------------------------------------

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, offsets) of ``positions`` in ``slots`` (broadcast against each other)."""
        if not self.paged:
            return slots, positions
        return self.table[slots, positions // self.block_size], positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, d] of rows ``slots`` [B, N] at ``positions`` [B, T]: row b
        goes into each of its N slots (a prompt's samples) in the same write; the values are
        broadcast, not copied. (A decode step writes through ``locate`` and ``write_kv``.)"""
        B, N = slots.shape
        T = positions.shape[1]
        blocks, at = self.locate(slots[:, :, None].expand(B, N, T), positions[:, None].expand(B, N, T))
        self.k[layer][blocks, :, at] = k.transpose(1, 2)[:, None]
        self.v[layer][blocks, :, at] = v.transpose(1, 2)[:, None]

    def span(self, t: torch.Tensor, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Positions [start, stop) of the request whose blocks ``blocks`` lists, in one layer's keys
        or values ``t``: [heads, stop - start, d] (a view within one block, else a copy)."""
        first, last = start // self.block_size, (stop - 1) // self.block_size
        if first == last:
            return t[blocks[first], :, start % self.block_size: (stop - 1) % self.block_size + 1]
        pos = torch.arange(start, stop)
        index = torch.tensor(blocks)[pos // self.block_size].to(t.device)
        return t[index, :, (pos % self.block_size).to(t.device)].transpose(0, 1)

    def write_span(self, t: torch.Tensor, blocks: list[int], start: int, stop: int, data: torch.Tensor) -> None:
        """Store ``data`` [heads, stop - start, d] at positions [start, stop) (see ``span``)."""
        first, last = start // self.block_size, (stop - 1) // self.block_size
        if first == last:
            t[blocks[first], :, start % self.block_size: (stop - 1) % self.block_size + 1] = data
            return
        pos = torch.arange(start, stop)
        index = torch.tensor(blocks)[pos // self.block_size].to(t.device)
        t[index, :, (pos % self.block_size).to(t.device)] = data.transpose(0, 1)

    def gather(self, layer: int, slots: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, span) of ``slots`` [G]: [G, kv_heads, span, d] each."""
        if not self.paged:
            return self.k[layer][slots, :, :span], self.v[layer][slots, :, :span]
        blocks = self.table[slots, : self.blocks_for(span)]  # [G, n]
        return tuple(_flatten_blocks(t[blocks])[:, :, :span] for t in (self.k[layer], self.v[layer]))


def _flatten_blocks(t: torch.Tensor) -> torch.Tensor:
    """[G, n, K, bs, d] -> [G, K, n * bs, d]."""
    G, n, K, bs, d = t.shape
    return t.permute(0, 2, 1, 3, 4).reshape(G, K, n * bs, d)
