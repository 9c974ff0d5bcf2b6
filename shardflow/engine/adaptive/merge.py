"""Which layout changes adaptive TP makes mid-decode, and what each rank keeps through one.

A switch from layout ``src`` to ``dst`` merges data-parallel replicas: the same ranks, pp = 1, tp
grows by a factor k >= 2 dividing dp, and every replica of ``dst`` is the union of k replicas of
``src``. The requests of those k replicas then decode as one batch on the union's ranks.

Whether the weights need any transfer is a separate property: ``dst`` *nests* in ``src`` when
every rank's slice of every tensor in ``dst`` lies inside its slice in ``src`` (heads, columns
and vocabulary rows; vocabulary padding is the same for every power-of-two tp). Then each rank
narrows its own tensors and nothing moves. ``split_replicas(final, k)`` gives starting layouts
that nest; any other merge still works, with the weights moved by reallocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import EMBED, LM_HEAD, RankShard, TensorShard, check_layout, shard_for


@dataclass(frozen=True)
class Merge:
    """A replica merge ``src`` -> ``dst``."""

    src: Layout
    dst: Layout
    groups: tuple[tuple[int, ...], ...]  # per dst replica: the src replicas it unites, ascending

    @property
    def factor(self) -> int:
        return self.dst.tp // self.src.tp

    def dst_replica_of(self, src_replica: int) -> int:
        return next(d for d, members in enumerate(self.groups) if src_replica in members)


@lru_cache(maxsize=256)
def plan_merge(src: Layout, dst: Layout) -> Merge:
    """The merge ``src`` -> ``dst``; ValueError saying why when ``dst`` is not reachable from
    ``src`` by merging replicas."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{dst} is not reachable from {src} by merging data-parallel replicas: {why}")

    if set(dst.ranks) != set(src.ranks):
        raise refuse("the two layouts must use the same ranks")
    if src.pp != 1 or dst.pp != 1:
        raise refuse("generation runs with pp=1")
    if dst.tp % src.tp or dst.tp // src.tp < 2:
        raise refuse(f"tp must grow by a whole factor of at least 2 (tp {src.tp} -> {dst.tp})")
    factor = dst.tp // src.tp
    if src.dp % factor:
        raise refuse(f"the factor {factor} must divide dp={src.dp}")
    replica_of = {r: src.coord(r).dp for r in src.ranks}
    groups = []
    for d in range(dst.dp):
        members = set(dst.replica_ranks(d))
        sources = sorted({replica_of[r] for r in members})
        if any(not set(src.replica_ranks(s)) <= members for s in sources):
            raise refuse(f"replica {d} of {dst} (ranks {sorted(members)}) is not a union of replicas of {src}")
        groups.append(tuple(sources))
    return Merge(src, dst, tuple(groups))


def window(shard: RankShard, ts: TensorShard) -> tuple[int, int]:
    """The full-tensor range the local tensor covers along ``ts.dim``, vocabulary padding included."""
    if ts.name in (EMBED, LM_HEAD):
        return shard.vocab_start, shard.vocab_start + shard.vocab_size
    return ts.start, ts.stop


@lru_cache(maxsize=1024)
def nests(cfg: ModelConfig, src: Layout, dst: Layout) -> bool:
    """Does every rank of ``dst`` hold, of every tensor, a sub-range of what it holds in ``src``?"""
    check_layout(cfg, dst)
    for rank in dst.ranks:
        if rank not in src:
            return False
        before, after = shard_for(cfg, src, rank), shard_for(cfg, dst, rank)
        for name, ts in after.tensors.items():
            old = before.tensors.get(name)
            if old is None or (ts.dim is None and old.dim is not None):
                return False
            if ts.dim is None:
                continue
            if old.dim not in (None, ts.dim):
                return False
            lo, hi = window(after, ts)
            old_lo, old_hi = (0, old.full_shape[ts.dim]) if old.dim is None else window(before, old)
            if not (old_lo <= lo and hi <= old_hi):
                return False
    return True


def narrow_offset(cfg: ModelConfig, src: Layout, dst: Layout, rank: int, name: str) -> int:
    """Where ``rank``'s tensor ``name`` in ``dst`` starts inside its tensor in ``src`` (along the
    split dim); the layouts must nest."""
    before, after = shard_for(cfg, src, rank), shard_for(cfg, dst, rank)
    ts, old = after.tensors[name], before.tensors[name]
    return window(after, ts)[0] - (0 if old.dim is None else window(before, old)[0])
