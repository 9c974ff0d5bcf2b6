"""The transfer plan of a parameter reallocation: who sends which slice to whom.

A model's weights move from layout A (say the training call's, where the optimizer state lives)
to layout B (the next call's). The plan is derived from the sharding spec alone: for every
destination rank and tensor it lists which source rank provides which local range, without
materialising any full tensor. It is a pure function of (model config, A, B), cached, and the
same on every rank, so both ends of every message agree on what it holds.

Every shard is a contiguous range of its full tensor along at most one dim, so the work is 1-D
interval arithmetic: the range a destination needs is cut at the boundaries of the source pieces,
and each cut segment is served by one holder:

- a local copy when the destination rank already holds the segment in A;
- otherwise the holder with the fewest bytes assigned so far, taking segments largest first, so
  that sending is spread over A's DP replicas (and over tp ranks holding replicated tensors, or
  the first and last stage for a tied LM head, whose ``source`` is the embedding).

The plan counts elements, not bytes: the dtype is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import TensorShard, check_layout, shard_for


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """``dst[name].narrow(dim, dst_start, length) = src[src_name].narrow(dim, src_start, length)``.

    Local tensors of both ranks; ``dim`` None means the whole tensor (start 0, length unused).
    """

    name: str  # destination parameter (HF name)
    src_name: str  # parameter on the source rank holding the values (the embedding for a tied head)
    src_rank: int
    dst_rank: int
    dim: int | None
    src_start: int
    dst_start: int
    length: int
    numel: int
    shape: tuple[int, ...]  # shape of the slice

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def src_view(self, tensor):
        return tensor if self.dim is None else tensor.narrow(self.dim, self.src_start, self.length)

    def dst_view(self, tensor):
        return tensor if self.dim is None else tensor.narrow(self.dim, self.dst_start, self.length)


@dataclass(frozen=True, eq=False, kw_only=True)
class TransferPlan:
    """Every transfer of a reallocation, ordered by (src rank, dst rank, dst tensor, range).

    Compared and hashed by identity: plans are cached, one object per (model, A, B).
    """

    cfg: ModelConfig
    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]
    lower_bound_numel: int  # what destinations need minus what they already hold in A

    @cached_property
    def by_pair(self) -> dict[tuple[int, int], tuple[Transfer, ...]]:
        """(src rank, dst rank) -> its transfers in plan order (local copies under (r, r))."""
        pairs: dict[tuple[int, int], list[Transfer]] = {}
        for t in self.transfers:
            pairs.setdefault((t.src_rank, t.dst_rank), []).append(t)
        return {k: tuple(v) for k, v in pairs.items()}

    def sends(self, rank: int) -> dict[int, tuple[Transfer, ...]]:
        """Peer -> what ``rank`` sends it (no local copies)."""
        return {d: ts for (s, d), ts in self.by_pair.items() if s == rank and d != rank}

    def recvs(self, rank: int) -> dict[int, tuple[Transfer, ...]]:
        """Peer -> what ``rank`` receives from it (no local copies)."""
        return {s: ts for (s, d), ts in self.by_pair.items() if d == rank and s != rank}

    def local(self, rank: int) -> tuple[Transfer, ...]:
        return self.by_pair.get((rank, rank), ())

    @cached_property
    def received_numel(self) -> int:
        return sum(t.numel for t in self.transfers if not t.local)

    @cached_property
    def local_numel(self) -> int:
        return sum(t.numel for t in self.transfers if t.local)

    @cached_property
    def sent_numel_by_rank(self) -> dict[int, int]:
        sent = {r: 0 for r in self.src.ranks}
        for t in self.transfers:
            if not t.local:
                sent[t.src_rank] += t.numel
        return sent


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _split_dim(dst_ts: TensorShard, holders: list[tuple[int, TensorShard]]) -> int | None:
    """The one dim along which any shard of this tensor is split (None: replicated everywhere)."""
    dims = {ts.dim for ts in [dst_ts] + [h for _, h in holders] if ts.dim is not None}
    assert len(dims) <= 1, f"{dst_ts.name} is split along several dims: {dims}"
    return dims.pop() if dims else None


def _full_range(ts: TensorShard, dim: int | None) -> tuple[int, int]:
    """Range of the full tensor along ``dim`` held by ``ts`` ((0, 1) for a whole-tensor transfer)."""
    if dim is None:
        return 0, 1
    if ts.dim is None:
        return 0, ts.full_shape[dim]
    return ts.start, ts.stop


@dataclass(frozen=True)
class _Segment:
    """A piece of one destination tensor that one source holder will provide."""

    order: int  # position in (dst rank, tensor, range) order, kept for a stable plan order
    dst_rank: int
    dst: TensorShard
    dim: int | None
    lo: int  # full-tensor range along dim
    hi: int
    holders: tuple[tuple[int, TensorShard], ...]  # src ranks holding all of [lo, hi)

    @property
    def numel(self) -> int:
        if self.dim is None:
            return _prod(self.dst.full_shape)
        return _prod(self.dst.full_shape) // self.dst.full_shape[self.dim] * (self.hi - self.lo)

    def transfer(self, src_rank: int, holder: TensorShard) -> Transfer:
        shape = self.dst.full_shape if self.dim is None else tuple(
            self.hi - self.lo if d == self.dim else s for d, s in enumerate(self.dst.full_shape))
        return Transfer(
            name=self.dst.name,
            src_name=holder.name,
            src_rank=src_rank,
            dst_rank=self.dst_rank,
            dim=self.dim,
            src_start=self.lo - _full_range(holder, self.dim)[0] if self.dim is not None else 0,
            dst_start=self.lo - _full_range(self.dst, self.dim)[0] if self.dim is not None else 0,
            length=self.hi - self.lo,
            numel=self.numel,
            shape=shape,
        )


def _holders(cfg: ModelConfig, layout: Layout) -> dict[str, list[tuple[int, TensorShard]]]:
    """Checkpoint tensor name -> every (rank, shard) of ``layout`` holding part of it."""
    holders: dict[str, list[tuple[int, TensorShard]]] = {}
    for rank in layout.ranks:
        for ts in shard_for(cfg, layout, rank).tensors.values():
            holders.setdefault(ts.source, []).append((rank, ts))
    return holders


def _segments(cfg: ModelConfig, src: Layout, dst: Layout) -> list[_Segment]:
    """What every destination needs, cut at the boundaries of the source pieces."""
    holders = _holders(cfg, src)
    segments: list[_Segment] = []
    for rank in dst.ranks:
        for ts in shard_for(cfg, dst, rank).tensors.values():
            candidates = holders[ts.source]
            dim = _split_dim(ts, candidates)
            lo, hi = _full_range(ts, dim)
            cuts = {lo, hi}
            for _, h in candidates:
                cuts.update(b for b in _full_range(h, dim) if lo < b < hi)
            bounds = sorted(cuts)
            for a, b in zip(bounds, bounds[1:]):
                covering = tuple((r, h) for r, h in candidates
                                 if _full_range(h, dim)[0] <= a and b <= _full_range(h, dim)[1])
                assert covering, f"no rank of {src} holds {ts.source}[{a}:{b}] along dim {dim}"
                segments.append(_Segment(len(segments), rank, ts, dim, a, b, covering))
    return segments


def _lower_bound(cfg: ModelConfig, src: Layout, dst: Layout) -> int:
    """Elements every destination needs, minus the overlap with what the same rank holds in A."""
    total = 0
    for rank in dst.ranks:
        held = {ts.source: ts for ts in shard_for(cfg, src, rank).tensors.values()} if rank in src else {}
        for ts in shard_for(cfg, dst, rank).tensors.values():
            whole = _prod(ts.full_shape)
            dim = ts.dim if ts.dim is not None else (held[ts.source].dim if ts.source in held else None)
            if dim is None:
                total += 0 if ts.source in held else whole
                continue
            row = whole // ts.full_shape[dim]
            lo, hi = _full_range(ts, dim)
            need = (hi - lo) * row
            if ts.source in held:
                h_lo, h_hi = _full_range(held[ts.source], dim)
                need -= max(0, min(hi, h_hi) - max(lo, h_lo)) * row
            total += need
    return total


@lru_cache(maxsize=128)
def transfer_plan(cfg: ModelConfig, src: Layout, dst: Layout) -> TransferPlan:
    """The plan moving ``cfg``'s weights from layout ``src`` to layout ``dst`` (any rank sets).

    Raises ValueError naming the problem if the model cannot be split into either layout.
    """
    for name, layout in (("source", src), ("destination", dst)):
        if not isinstance(layout, Layout):
            raise ValueError(f"{name} layout must be a Layout, got {layout!r}")
        check_layout(cfg, layout)
    segments = _segments(cfg, src, dst)

    chosen: dict[int, Transfer] = {}
    remote: list[_Segment] = []
    for seg in segments:
        local = [h for r, h in seg.holders if r == seg.dst_rank]
        if local:
            chosen[seg.order] = seg.transfer(seg.dst_rank, local[0])
        else:
            remote.append(seg)
    # Largest first onto the least-loaded holder: greedy balancing of bytes sent per source rank.
    load = {r: 0 for r in src.ranks}
    for seg in sorted(remote, key=lambda s: (-s.numel, s.order)):
        rank, holder = min(seg.holders, key=lambda rh: (load[rh[0]], rh[0]))
        load[rank] += seg.numel
        chosen[seg.order] = seg.transfer(rank, holder)

    transfers = sorted((chosen[s.order] for s in segments),
                       key=lambda t: (t.src_rank, t.dst_rank))  # stable: keeps segment order per pair
    return TransferPlan(cfg=cfg, src=src, dst=dst, transfers=tuple(transfers),
                        lower_bound_numel=_lower_bound(cfg, src, dst))
