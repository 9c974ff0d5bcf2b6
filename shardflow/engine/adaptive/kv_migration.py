"""Requests of merged replicas into one batch, their KV caches re-split by heads.

At a switch every rank of a merged replica needs every request of the replicas it unites and, for
each, the KV heads its new tp index holds. Two ways to get them:

- **migrate**: the heads move rank to rank. Every layout's cache is a regrouped view of the same
  memory (``KVCache.regroup``), so a request of the rank's own replica whose new heads lie inside
  its old ones stays where it is: only its slot number changes (in a paged cache, its blocks map
  to their sub-blocks of its heads). Every other (request, rank) pair receives its heads
  point-to-point from a rank of the request's old replica that holds them, into a *clean* slot or
  clean blocks (not part of an old active slot or block, so they hold nothing still to be sent;
  where a paged cache lacks them on some rank, every rank recomputes instead). Messages are cut
  into buckets of at most ``bucket_bytes`` per peer and round: a rank's extra memory is at most
  2 x bucket_bytes x its peers.
- **recompute**: the KV is dropped and each request is prefilled again in the new layout from
  ``prompt + output[:-1]`` (the engine's path for requests arriving with generated tokens).

The cost model (``switch_cost``) picks one per switch. Collectives: one ``all_gather_object`` of
the request states over the merged replica's ranks; for migration, ``comm.exchange`` rounds
(batched isend/irecv on the default group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardflow.config.experiment import KV_MODES
from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.merge import Merge
from shardflow.engine.generate.kv_cache import KVCache
from shardflow.engine.generate.requests import Request
from shardflow.parallel import comm
from shardflow.parallel.sharding import shard_for

MIGRATE, RECOMPUTE = KV_MODES


# ----- the request states -------------------------------------------------------------------------

@dataclass
class ReplicaRequests:
    replica: int  # index in the layout being left
    active: list[Request]  # in batch order
    waiting: list[Request]  # in queue order
    parked: list[Request] = field(default_factory=list)  # episodes between turns (no KV)


def gather_requests(group: ProcessGroup | None, merge: Merge, rank: int, active: list[Request],
                    waiting: list[Request], parked: list[Request] = ()) -> list[ReplicaRequests]:
    """Every replica that merges with this rank's, in merge order, with its unfinished requests.

    One ``all_gather_object`` over the merged replica's ranks: each old replica's tp-0 rank sends
    its requests (every tp rank holds the same state). This rank's own replica keeps its own
    request objects; the others arrive as copies, without slots.
    """
    c = merge.src.coord(rank)
    payload = (c.dp, active, waiting, list(parked)) if c.tp == 0 else None
    if group is None:
        gathered = [payload]
    else:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, payload, group=group)
    by_replica = {p[0]: (p[1], p[2], p[3]) for p in gathered if p is not None}
    by_replica[c.dp] = (active, waiting, list(parked))
    out = []
    for m in merge.groups[merge.dst_replica_of(c.dp)]:
        act, wait, between = by_replica[m]
        if m != c.dp:
            for r in (*act, *wait):
                r.slot = None
        out.append(ReplicaRequests(m, list(act), list(wait), list(between)))
    return out


# ----- which heads each rank keeps or receives -----------------------------------------------------

def _heads(cfg: ModelConfig, layout, rank: int) -> tuple[int, int]:
    """(first global KV head, count) held by ``rank``."""
    shard = shard_for(cfg, layout, rank)
    return shard.kv_head_start, shard.num_kv_heads


@lru_cache(maxsize=1024)
def keeps_own(cfg: ModelConfig, merge: Merge, rank: int) -> bool:
    """Does ``rank`` already hold, for the requests of its own old replica, the heads it needs?"""
    new0, new_n = _heads(cfg, merge.dst, rank)
    old0, old_n = _heads(cfg, merge.src, rank)
    return old0 <= new0 and new0 + new_n <= old0 + old_n


@lru_cache(maxsize=256)
def regroup_factor(cfg: ModelConfig, merge: Merge) -> int:
    """Slots of the new cache view per slot of the old one (old KV heads per rank / new)."""
    rank = merge.src.ranks[0]
    return _heads(cfg, merge.src, rank)[1] // _heads(cfg, merge.dst, rank)[1]


def fit_problem(cfg: ModelConfig, merge: Merge, active: Sequence[int], slots: int, mode: str, *,
                paged: bool = False) -> str | None:
    """Why the switch does not fit in the KV caches (None if it does).

    ``active``: active requests per old replica; ``slots``: slots of every rank's old cache view.
    Every merged replica must fit its active requests in the new view's slots; migration also
    needs, on each rank, a clean slot for every request it receives (in a ``paged`` cache, clean
    blocks, which the counts here cannot tell: the switch checks them, see ``clean_blocks``).
    """
    f = regroup_factor(cfg, merge)
    new_slots = (slots + 1) * f - 1
    for q, members in enumerate(merge.groups):
        total = sum(active[m] for m in members)
        if total > new_slots:
            return (f"replica {q} of {merge.dst} would decode {total} requests, but a rank's KV cache holds "
                    f"{new_slots} in that layout")
        if mode != MIGRATE or paged:
            continue
        for rank in merge.dst.replica_ranks(q):
            own = active[merge.src.coord(rank).dp]
            receive = total - (own if keeps_own(cfg, merge, rank) else 0)
            clean = (slots + 1 - own) * f - 1
            if receive > clean:
                return (f"migrating KV to {merge.dst} needs {receive} free KV slots on rank {rank}, which has "
                        f"{clean}; recompute instead")
    return None


@dataclass(frozen=True)
class Chunk:
    """Positions [start, stop) of one request's keys (tensor 0) or values (1) in one layer; on the
    sender they sit in blocks ``b * f + sub`` of the new cache view, b its blocks in the old one."""

    request_id: int
    layer: int
    tensor: int
    start: int
    stop: int
    sub: int


@dataclass
class KVPlan:
    """Migration within one merged replica; the same on each of its ranks."""

    heads: int  # KV heads per slot in the new layout
    kept: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> request id -> sub-slot
    received: dict[int, list[int]] = field(default_factory=dict)  # rank -> request ids, batch order
    messages: dict[tuple[int, int], list[list[Chunk]]] = field(default_factory=dict)  # (src, dst) -> buckets

    def rounds(self, rank: int) -> int:
        return max((len(m) for (s, d), m in self.messages.items() if rank in (s, d)), default=0)

    def bytes_moved(self, rank: int, per_position: int) -> tuple[int, int]:
        """(sent, received) bytes of ``rank``."""
        def size(pairs):
            return sum((c.stop - c.start) * per_position for _, m in pairs for msg in m for c in msg)
        return (size((k, m) for k, m in self.messages.items() if k[0] == rank),
                size((k, m) for k, m in self.messages.items() if k[1] == rank))

    def peak_buffer_bytes(self, rank: int, per_position: int) -> int:
        """The most send + receive buffer bytes ``rank`` holds in one round."""
        peak = 0
        for i in range(self.rounds(rank)):
            peak = max(peak, sum((c.stop - c.start) * per_position for (s, d), m in self.messages.items()
                                 if rank in (s, d) and i < len(m) for c in m[i]))
        return peak


def kv_plan(cfg: ModelConfig, merge: Merge, replica: int, requests: Sequence[tuple[int, int, int]],
            layers: Sequence[int], per_position: int, bucket_bytes: int) -> KVPlan:
    """Where the heads of each ``(request id, old replica, cached length)`` of new replica
    ``replica`` come from, for each of its ranks. ``per_position``: bytes of one position of one
    layer's keys (or values) in the new layout. A rank keeps a request when it held it with the
    heads it needs; otherwise a holder sends them (holders taken in turn when several hold them,
    e.g. KV heads replicated over tp > num_kv_heads)."""
    ranks = merge.dst.replica_ranks(replica)
    new = {d: _heads(cfg, merge.dst, d) for d in ranks}
    old = {p: _heads(cfg, merge.src, p) for p in ranks}
    plan = KVPlan(heads=new[ranks[0]][1], kept={d: {} for d in ranks}, received={d: [] for d in ranks})
    pieces: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for request_id, src_replica, length in requests:
        holders_of = merge.src.replica_ranks(src_replica)
        for i, d in enumerate(ranks):
            start, n = new[d]
            holders = [p for p in holders_of if old[p][0] <= start and start + n <= old[p][0] + old[p][1]]
            assert holders, f"no rank of replica {src_replica} of {merge.src} holds KV heads {start}-{start + n - 1}"
            if d in holders:
                plan.kept[d][request_id] = (start - old[d][0]) // n
                continue
            p = holders[i % len(holders)]
            pieces.setdefault((p, d), []).append((request_id, length, (start - old[p][0]) // n))
            plan.received[d].append(request_id)
    step = max(1, bucket_bytes // per_position)  # positions per chunk at most
    for pair, items in pieces.items():
        buckets: list[list[Chunk]] = [[]]
        used = 0
        for request_id, length, sub in items:
            for layer in layers:
                for tensor in (0, 1):
                    for start in range(0, length, step):
                        stop = min(length, start + step)
                        size = (stop - start) * per_position
                        if buckets[-1] and used + size > bucket_bytes:
                            buckets.append([])
                            used = 0
                        buckets[-1].append(Chunk(request_id, layer, tensor, start, stop, sub))
                        used += size
        plan.messages[pair] = buckets
    return plan


def clean_slots(num_slots: int, factor: int, old_active_slots: Sequence[int]) -> list[int]:
    """Slots of the new view (``num_slots``, scratch excluded) outside every old active slot."""
    dirty = {s * factor + j for s in old_active_slots for j in range(factor)}
    return [s for s in range(num_slots) if s not in dirty]


@torch.no_grad()
def migrate(plan: KVPlan, rank: int, cache: KVCache, factor: int, old_blocks: dict[int, list[int]],
            new_blocks: dict[int, list[int]]) -> tuple[int, int]:
    """Run this rank's part of ``plan`` on ``cache`` (the new layout's view). ``old_blocks``:
    request id -> its blocks in the old view, for requests this rank sends; ``new_blocks``: request
    id -> its blocks in the new view, for those it receives (a contiguous cache's block is its
    slot). Returns (messages posted, bytes received)."""
    first = next(iter(cache.k.values()))
    heads, dim, dtype, device = plan.heads, first.shape[3], first.dtype, first.device
    tensors = (cache.k, cache.v)
    posted = received_bytes = 0
    for i in range(plan.rounds(rank)):
        sends, recvs, unpack = [], [], []
        for (src, dst), buckets in plan.messages.items():
            if i >= len(buckets):
                continue
            msg = buckets[i]
            if src == rank:
                parts = [cache.span(tensors[c.tensor][c.layer], [b * factor + c.sub for b in old_blocks[c.request_id]],
                                    c.start, c.stop).reshape(-1) for c in msg]  # each [heads * positions * dim]
                sends.append((torch.cat(parts), dst))
            if dst == rank:
                numel = sum((c.stop - c.start) * heads * dim for c in msg)
                recvs.append(((numel,), dtype, device, src))
                unpack.append(msg)
        buffers = comm.exchange(sends, recvs)
        posted += len(sends) + len(recvs)
        for msg, buf in zip(unpack, buffers):
            offset = 0
            for c in msg:
                n = (c.stop - c.start) * heads * dim
                cache.write_span(tensors[c.tensor][c.layer], new_blocks[c.request_id], c.start, c.stop,
                                 buf[offset:offset + n].view(heads, c.stop - c.start, dim))
                offset += n
            received_bytes += buf.numel() * buf.element_size()
    return posted, received_bytes
