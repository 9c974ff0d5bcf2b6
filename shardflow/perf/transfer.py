"""Cost of moving parameters between layouts (reallocation) and data between calls.

Reallocation from layout A to layout B: each destination rank must receive what it needs in B
minus what it already holds in A, both read off the sharding spec (``shard_for``). Pieces that some
rank of A on the same node holds come over NVLink; the rest comes over the inter-node network.
Destination ranks receive in parallel, so the time is the slowest destination's. (Senders are
assumed spread over A's data-parallel replicas, as the reallocation engine does.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for
from shardflow.perf.hardware import Cluster

# piece: (first layer, end layer, start, stop, elements per index). Decoder-layer tensors are
# keyed by their name inside a layer and cover the stage's layers; other tensors cover (0, 1).
Piece = tuple[int, int, int, int, int]


@lru_cache(maxsize=8192)
def holding(cfg: ModelConfig, pp: int, tp: int, stage: int, tp_index: int) -> dict[str, Piece]:
    """What a rank at (stage, tp_index) of any (pp, *, tp) layout holds, keyed by checkpoint tensor
    (a tied LM head is keyed by the embedding it copies, so either can serve it)."""
    layout = Layout.contiguous(pp=pp, tp=tp)
    shard = shard_for(cfg, layout, layout.rank_at(stage, 0, tp_index))
    lo, hi = (shard.layers[0], shard.layers[-1] + 1) if shard.layers else (0, 0)
    out: dict[str, Piece] = {}
    for name, t in shard.tensors.items():
        if name.startswith("model.layers."):
            key, span = "layer." + name.split(".", 3)[3], (lo, hi)
        else:
            key, span = t.source, (0, 1)
        dim = 0 if t.dim is None else t.dim
        start, stop = (0, t.full_shape[0]) if t.dim is None else (t.start, t.stop)
        elems = 1
        for d, size in enumerate(t.full_shape):
            if d != dim:
                elems *= size
        out[key] = (*span, start, stop, elems)
    return out


def _uncovered(start: int, stop: int, intervals: list[tuple[int, int]]) -> int:
    """Length of [start, stop) not covered by the intervals."""
    covered, pos = 0, start
    for a, b in sorted(intervals):
        a, b = max(a, pos), min(b, stop)
        if b > a:
            covered += b - a
            pos = b
    return (stop - start) - covered


def missing_elements(need: dict[str, Piece], held: list[dict[str, Piece]]) -> int:
    """Elements of ``need`` that none of the ``held`` pieces cover."""
    total = 0
    for key, (lo, hi, start, stop, elems) in need.items():
        pieces = [p for h in held if (p := h.get(key)) is not None and p[0] < hi and p[1] > lo]
        if len(pieces) <= 1:  # the common case (what a rank holds itself): one overlap
            layers = min(hi, pieces[0][1]) - max(lo, pieces[0][0]) if pieces else 0
            cover = max(0, min(stop, pieces[0][3]) - max(start, pieces[0][2])) if pieces else 0
            total += ((hi - lo) * (stop - start) - layers * cover) * elems
            continue
        # split the needed layers where a holder's stage begins or ends
        cuts = sorted({lo, hi, *(c for p in pieces for c in p[:2] if lo < c < hi)})
        for a, b in zip(cuts, cuts[1:]):
            over = [(p[2], p[3]) for p in pieces if p[0] <= a and p[1] >= b]
            total += (b - a) * _uncovered(start, stop, over) * elems
    return total


def _coords(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranks, stage and tp index of every rank of a layout (rank order pp > dp > tp)."""
    ranks = np.asarray(layout.ranks)
    i = np.arange(layout.size)
    return ranks, i // (layout.dp * layout.tp), i % layout.tp


def _coord_fn(layout: Layout):
    """rank -> (stage, tp index)."""
    def coord(r: int) -> tuple[int, int]:
        c = layout.coord(r)
        return c.pp, c.tp
    return coord


def _spans_nodes(cluster: Cluster, *layouts: Layout) -> bool:
    return not cluster.one_node((min(min(lay.ranks) for lay in layouts), max(max(lay.ranks) for lay in layouts)))


@lru_cache(maxsize=65536)
def _missing(cfg: ModelConfig, dst_shape: tuple[int, int], dst_coord: tuple[int, int], src_shape: tuple[int, int],
             src_coords: frozenset) -> int:
    """Elements a rank at ``dst_coord`` of a (pp, tp) = ``dst_shape`` layout needs that no rank at
    ``src_coords`` of a ``src_shape`` layout holds."""
    need = holding(cfg, *dst_shape, *dst_coord)
    return missing_elements(need, [holding(cfg, *src_shape, *c) for c in sorted(src_coords)])


def realloc_seconds(cfg: ModelConfig, src: Layout, dst: Layout, cluster: Cluster, dtype_bytes: int = 2) -> float:
    """Seconds to bring a model from layout ``src`` into layout ``dst``."""
    if src == dst:
        return 0.0
    return _realloc_seconds(cfg, src, dst, cluster, dtype_bytes)


@lru_cache(maxsize=65536)
def _realloc_seconds(cfg: ModelConfig, src: Layout, dst: Layout, cluster: Cluster, dtype_bytes: int) -> float:
    g = cluster.gpus_per_node
    s_ranks, s_stage, s_tp = _coords(src)
    d_ranks, d_stage, d_tp = _coords(dst)
    # Source coordinates present on each node: the candidates for an NVLink transfer.
    near: dict[int, frozenset] = {}
    for node in np.unique(s_ranks // g):
        on = s_ranks // g == node
        near[int(node)] = frozenset(zip(s_stage[on].tolist(), s_tp[on].tolist()))
    # Each destination rank's own source coordinate, if it holds the model in ``src`` too.
    order = np.argsort(s_ranks)
    found = order[np.searchsorted(s_ranks[order], d_ranks).clip(max=len(s_ranks) - 1)]
    has_own = s_ranks[found] == d_ranks
    own_index = found
    own_stage = np.where(has_own, s_stage[own_index], -1)
    own_tp = np.where(has_own, s_tp[own_index], -1)
    # Destination ranks alike (coordinate, own source coordinate, node contents) need the same
    # transfers: cost each kind once.
    node_kind = {n: i for i, n in enumerate(sorted(set(near.values()), key=sorted))}
    first, last = int(d_ranks.min()) // g, int(d_ranks.max()) // g
    node_ids = np.array([node_kind.get(near.get(n), -1) for n in range(first, last + 1)])
    near_id = node_ids[d_ranks // g - first]
    kinds = np.unique(np.stack([d_stage, d_tp, own_stage, own_tp, near_id], axis=1), axis=0)
    by_id = {i: nodeset for nodeset, i in node_kind.items()}
    worst = 0.0
    for stage, tp_index, o_stage, o_tp, nid in kinds.tolist():
        coord = (stage, tp_index)
        own = frozenset(((o_stage, o_tp),)) if o_stage >= 0 else frozenset()
        missing = _missing(cfg, (dst.pp, dst.tp), coord, (src.pp, src.tp), own)
        remote = _missing(cfg, (dst.pp, dst.tp), coord, (src.pp, src.tp), by_id.get(nid, frozenset()))
        worst = max(worst, (missing - remote) * dtype_bytes / cluster.p2p_bandwidth
                    + remote * dtype_bytes / cluster.inter_node_bandwidth)
    crosses = _spans_nodes(cluster, src, dst)
    return worst + (cluster.inter_node_latency if crosses else cluster.intra_node_latency)


def received_bytes(cfg: ModelConfig, src: Layout, dst: Layout, rank: int, dtype_bytes: int = 2) -> int:
    """Bytes rank ``rank`` of ``dst`` must receive: what it needs minus what it holds in ``src``."""
    own = frozenset((_coord_fn(src)(rank),)) if rank in src else frozenset()
    return _missing(cfg, (dst.pp, dst.tp), _coord_fn(dst)(rank), (src.pp, src.tp), own) * dtype_bytes


# ----- data between calls -------------------------------------------------------------------

# bytes per token and per sequence of each batch key (see shardflow.rl.graphs): responses carry
# int64 ids, a float loss mask and the generator's float log-probs; rewards one float per sequence.
KEY_BYTES: dict[str, tuple[int, int]] = {
    "responses": (8 + 4 + 4, 16),
    "rewards": (0, 4),
    "ref_logprobs": (4, 0),
    "values": (4, 0),
}
DEFAULT_KEY_BYTES = (4, 0)


def data_bytes(key: str, sequences: int, mean_tokens: float) -> float:
    per_token, per_seq = KEY_BYTES.get(key, DEFAULT_KEY_BYTES)
    return sequences * (per_token * mean_tokens + per_seq)


def data_seconds(nbytes: float, src: Layout, dst: Layout, cluster: Cluster) -> float:
    """Moving a key's data from the producer's DP replicas (each holds its share) to the consumer's
    (each receives its share); nothing moves when both calls share a layout."""
    if src == dst or nbytes == 0:
        return 0.0
    share = nbytes / min(src.dp, dst.dp)
    if not _spans_nodes(cluster, src, dst):
        return cluster.intra_node_latency + share / cluster.p2p_bandwidth
    return cluster.inter_node_latency + share / cluster.inter_node_bandwidth
