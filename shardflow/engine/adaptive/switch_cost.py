"""What a switch costs, by part: weights, KV caches, communication groups, CUDA graphs.

- weights: nothing when the target nests in the starting layout (views); otherwise the bytes the
  busiest rank receives by reallocation over the point-to-point bandwidth;
- KV, migrated: the bytes the busiest rank sends or receives (its new heads of every request it
  did not hold) over the point-to-point bandwidth, plus a latency per round of messages;
- KV, recomputed: a prefill of every moved request's prompt and generated tokens in the new
  layout (merged replicas prefill in parallel; the slowest counts);
- groups: none, they are created before generation starts;
- graphs: a fixed time per decode graph the new layout has not captured yet;
- plus a fixed overhead for exchanging the request states and synchronising.

``estimate`` returns the cheaper KV mode among those allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.kv_migration import MIGRATE, RECOMPUTE, keeps_own
from shardflow.engine.adaptive.merge import Merge
from shardflow.parallel.sharding import shard_for
from shardflow.perf.hardware import Cluster
from shardflow.perf.step_time import StepTimeModel


@dataclass(frozen=True, kw_only=True)
class SwitchCost:
    kv_mode: str
    weights_s: float = 0.0
    kv_s: float = 0.0
    groups_s: float = 0.0
    graphs_s: float = 0.0
    overhead_s: float = 0.0
    kv_bytes: int = 0  # migrated bytes on the busiest rank (0 when recomputed)

    @property
    def total(self) -> float:
        return self.weights_s + self.kv_s + self.groups_s + self.graphs_s + self.overhead_s


@dataclass(frozen=True, kw_only=True)
class CostParams:
    graph_capture_s: float = 0.03  # per decode graph captured (warm-up runs and capture)
    overhead_s: float = 0.005  # request exchange and synchronisation
    round_latency_s: float = 50e-6  # per round of KV messages
    bucket_bytes: int = 64 << 20  # KV migration message size (as in the generator)


class SwitchCostModel:
    def __init__(self, cfg: ModelConfig, steps: StepTimeModel, cluster: Cluster = Cluster(),
                 params: CostParams = CostParams(), *, dtype_bytes: int = 2):
        self.cfg, self.steps, self.cluster, self.params, self.item = cfg, steps, cluster, params, dtype_bytes

    def kv_bytes_per_token(self, merge: Merge) -> int:
        """Bytes of one token's keys and values (all layers) on one rank of the new layout."""
        shard = shard_for(self.cfg, merge.dst, merge.dst.ranks[0])
        return 2 * len(shard.layers) * shard.num_kv_heads * self.cfg.head_dim * self.item

    def migrate_seconds(self, merge: Merge, active: Sequence[float], context: Sequence[float]) -> tuple[float, int]:
        """(seconds, bytes on the busiest rank) to migrate; per old replica its active requests
        and their mean context."""
        per_token = self.kv_bytes_per_token(merge)
        busiest = 0.0
        for q, members in enumerate(merge.groups):
            total = sum(active[m] * context[m] for m in members)
            for rank in merge.dst.replica_ranks(q):
                own = merge.src.coord(rank).dp
                kept = active[own] * context[own] if keeps_own(self.cfg, merge, rank) else 0.0
                busiest = max(busiest, (total - kept) * per_token)
        rounds = busiest / self.params.bucket_bytes + 1
        return busiest / self.cluster.p2p_bandwidth + rounds * self.params.round_latency_s, int(busiest)

    def recompute_seconds(self, merge: Merge, active: Sequence[float], context: Sequence[float]) -> float:
        slowest = 0.0
        for members in merge.groups:
            tokens = sum(active[m] * context[m] for m in members)
            if tokens > 0:
                mean = tokens / max(sum(active[m] for m in members), 1e-9)
                slowest = max(slowest, self.steps.prefill(merge.dst.tp, tokens, mean))
        return slowest

    def estimate(self, merge: Merge, active: Sequence[float], context: Sequence[float], *,
                 weight_bytes: int = 0, new_graphs: int = 0,
                 modes: Sequence[str] = (MIGRATE, RECOMPUTE)) -> SwitchCost | None:
        """The cheaper allowed KV mode's cost (None when no mode is allowed)."""
        common = dict(weights_s=weight_bytes / self.cluster.p2p_bandwidth,
                      graphs_s=new_graphs * self.params.graph_capture_s,
                      overhead_s=self.params.overhead_s)
        options = []
        if MIGRATE in modes:
            seconds, nbytes = self.migrate_seconds(merge, active, context)
            options.append(SwitchCost(kv_mode=MIGRATE, kv_s=seconds, kv_bytes=nbytes, **common))
        if RECOMPUTE in modes:
            options.append(SwitchCost(kv_mode=RECOMPUTE, kv_s=self.recompute_seconds(merge, active, context), **common))
        return min(options, key=lambda c: c.total) if options else None
