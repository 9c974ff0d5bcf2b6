"""A cluster to plan for: nodes x GPUs per node, memory, compute and link rates.

The defaults describe a node of eight H200 GPUs with NVLink inside the node and one NIC per GPU
between nodes (the field values below). They are only a starting point: a measured profile
(``shardflow profile``) replaces the rates it measured (``Cluster.with_rates``), and every field
can be set for a cluster that is not at hand. The planner and adaptive TP read the same rates.

Ranks are numbered node by node: node ``n`` holds ranks ``n * gpus_per_node`` onwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_nodes: int = 1
    gpus_per_node: int = 8
    memory_bytes: float = 141 * GB  # per GPU
    usable_memory_fraction: float = 0.9  # the rest: CUDA context, allocator fragmentation, workspaces
    matmul_flops: float = 790e12  # dense bf16 GEMM rate per GPU
    hbm_bandwidth: float = 4.3e12  # device memory copy bandwidth, bytes/s
    intra_node_bandwidth: float = 360 * GB  # all-reduce bus bandwidth over NVLink, bytes/s per GPU
    inter_node_bandwidth: float = 45 * GB  # bus bandwidth per GPU across nodes (400 Gb/s NIC)
    p2p_bandwidth: float = 360 * GB  # one point-to-point stream inside a node
    intra_node_latency: float = 10e-6  # per collective inside a node, seconds
    inter_node_latency: float = 25e-6  # per collective across nodes
    host_bandwidth: float = 50 * GB  # CPU <-> GPU (offloaded weights), bytes/s per GPU
    layer_overhead_s: float = 10e-6  # kernel launches etc. per decoder layer and pass (roofline)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value <= 0:
                raise ValueError(f"cluster {f.name} must be positive, got {value!r}")
        if self.gpus_per_node & (self.gpus_per_node - 1):
            raise ValueError(
                f"gpus_per_node must be a power of two (device sets are aligned blocks of 1, 2, 4, ... "
                f"GPUs), got {self.gpus_per_node}"
            )
        if self.usable_memory_fraction > 1:
            raise ValueError(f"usable_memory_fraction must be at most 1, got {self.usable_memory_fraction}")

    @classmethod
    def for_devices(cls, devices: int | None = None, *, nodes: int | None = None, gpus_per_node: int = 8,
                    **rates: float) -> "Cluster":
        """``devices`` GPUs (one node when they fit in one, else whole nodes of ``gpus_per_node``),
        or ``nodes`` x ``gpus_per_node``. Raises naming the count that cannot be arranged."""
        if (devices is None) == (nodes is None):
            raise ValueError("give either a device count or a node count (with GPUs per node), not both")
        if nodes is not None:
            if nodes < 1:
                raise ValueError(f"node count must be positive, got {nodes}")
            return cls(num_nodes=nodes, gpus_per_node=gpus_per_node, **rates)
        if devices < 1:
            raise ValueError(f"device count must be positive, got {devices}")
        if devices <= gpus_per_node:
            if devices & (devices - 1):
                raise ValueError(
                    f"{devices} devices cannot be planned: device sets are aligned blocks of 1, 2, 4, 8, ... "
                    "GPUs, so a single node needs a power-of-two GPU count"
                )
            return cls(num_nodes=1, gpus_per_node=devices, **rates)
        if devices % gpus_per_node:
            raise ValueError(
                f"{devices} devices cannot be split into whole nodes of {gpus_per_node} GPUs; "
                "give a multiple of the GPUs per node (or --nodes N --gpus-per-node G)"
            )
        return cls(num_nodes=devices // gpus_per_node, gpus_per_node=gpus_per_node, **rates)

    def with_rates(self, **rates: float) -> "Cluster":
        """A copy with some rates replaced (e.g. the ones a profile measured)."""
        return dataclasses.replace(self, **rates)

    # ----- topology --------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def one_node(self, ranks: tuple[int, ...] | range) -> bool:
        """Whether the ranks (in any order) share a node."""
        return self.node_of(min(ranks)) == self.node_of(max(ranks)) if len(ranks) else True

    def bus_bandwidth(self, ranks: tuple[int, ...] | range) -> float:
        """Collective bus bandwidth of a group: NVLink inside one node, the NICs across nodes."""
        return self.intra_node_bandwidth if self.one_node(ranks) else self.inter_node_bandwidth

    def latency(self, ranks: tuple[int, ...] | range) -> float:
        return self.intra_node_latency if self.one_node(ranks) else self.inter_node_latency

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.gpus_per_node} GPUs, {self.memory_bytes / GB:.0f} GB each, "
                f"{self.matmul_flops / 1e12:.0f} TFLOP/s, {self.hbm_bandwidth / 1e12:.1f} TB/s HBM, "
                f"{self.intra_node_bandwidth / GB:.0f} GB/s intra-node, {self.inter_node_bandwidth / GB:.0f} GB/s "
                "inter-node")
