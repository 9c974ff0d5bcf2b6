"""How long one replica's decode step takes, by (tp, active batch, context length).

The switch policy asks for many (batch, context) points at once, so every model answers numpy
arrays. Three sources, one interface (``decode`` and ``prefill``):

- ``RooflineStepTime``: weights read once per step and the KV cache read by attention, against HBM
  bandwidth, or the FLOPs against the GEMM rate when batches are large; plus tensor parallelism's
  collectives (two all-reduces per layer, one for the embedding, one all-gather for sampling),
  each a latency plus bytes over the NVLink bus bandwidth. Sizes come from ``shard_for``.
- ``TableStepTime``: measured step times on a (batch, context) grid per tp, interpolated
  bilinearly (decode time is close to affine in both), with the roofline for any tp not measured
  (scaled by the measured/roofline ratio of the nearest measured tp). ``add_comm`` adds the
  modelled collectives to tables measured on one GPU without them. Prefill: measured seconds per
  token per tp where given (prefill of a full batch is compute-bound, close to linear in tokens),
  else the roofline. Saved as JSON by the benchmark.
- ``LayerStepTime``: a per-layer decode time from elsewhere (e.g. the planner's profiled
  ``OpCosts.decode_layer`` bound to the model config) times the layers, plus the head and the
  collectives from the roofline.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import EMBED, shard_for
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import FORMAT as PROFILE_FORMAT
from shardflow.perf.profile import OpCosts, Profile

FORMAT = "shardflow-decode-steps/1"


class StepTimeModel(Protocol):
    def decode(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of one replica of ``batch`` requests of mean length ``context``."""

    def prefill(self, tp: int, tokens: float, context: float) -> float:
        """Seconds to prefill ``tokens`` tokens in sequences of mean length ``context``."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Rates of one GPU and its links (defaults: an H200 with NVLink)."""

    hbm_bandwidth: float = 4.3e12  # bytes/s, device copy
    matmul_flops: float = 790e12  # dense bf16 GEMM rate
    matmul_efficiency: float = 0.7  # fraction of the GEMM rate decode/prefill GEMMs reach
    bus_bandwidth: float = 360e9  # all-reduce bus bandwidth per GPU, bytes/s
    p2p_bandwidth: float = 300e9  # one point-to-point stream, bytes/s
    collective_latency: float = 15e-6  # seconds per collective
    step_overhead: float = 40e-6  # per decode step: launches, host synchronisation, sampling

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"hardware {name} must be positive, got {value!r}")


class RooflineStepTime:
    def __init__(self, cfg: ModelConfig, hardware: Hardware = Hardware(), *, dtype_bytes: int = 2):
        self.cfg, self.hw, self.item = cfg, hardware, dtype_bytes
        self._shapes: dict[int, tuple[int, int, int]] = {}

    def shape(self, tp: int) -> tuple[int, int, int]:
        """(GEMM parameters per rank, KV elements per token per rank, query width per rank)."""
        if tp not in self._shapes:
            shard = shard_for(self.cfg, Layout.contiguous(tp=tp), 0)
            read = [t for name, t in shard.tensors.items() if name != EMBED or self.cfg.tie_word_embeddings]
            params = sum(t.numel() for t in read)  # the embedding is read row by row, unless tied to the head
            kv = 2 * len(shard.layers) * shard.num_kv_heads * self.cfg.head_dim
            self._shapes[tp] = (params, kv, shard.num_heads * self.cfg.head_dim)
        return self._shapes[tp]

    def comm(self, tp: int, batch: np.ndarray) -> np.ndarray:
        """Collectives of one decode step: 2 all-reduces per layer and one for the embedding of
        [batch, hidden], and the sampling all-gather of candidates, counted as [batch, 5] float64
        per rank (the GPU sampler sends a few such rows per chunk of its vocabulary: still far below
        the collective's latency)."""
        batch = np.asarray(batch, dtype=np.float64)
        if tp == 1:
            return np.zeros_like(batch)
        ring = 2 * (tp - 1) / tp
        reduce = self.hw.collective_latency + ring * batch * self.cfg.hidden_size * self.item / self.hw.bus_bandwidth
        gather = self.hw.collective_latency + (tp - 1) * batch * 5 * 8 / self.hw.bus_bandwidth
        return (2 * self.cfg.num_layers + 1) * reduce + gather

    def compute(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        """The step without collectives: memory or FLOPs, whichever binds, plus the overhead."""
        params, kv, q_width = self.shape(tp)
        batch, context = np.asarray(batch, dtype=np.float64), np.asarray(context, dtype=np.float64)
        memory = (params + batch * context * kv) * self.item / self.hw.hbm_bandwidth
        flops = 2 * batch * params + 4 * batch * context * q_width * self.cfg.num_layers
        return np.maximum(memory, flops / (self.hw.matmul_flops * self.hw.matmul_efficiency)) + self.hw.step_overhead

    def decode(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        return self.compute(tp, batch, context) + self.comm(tp, batch)

    def prefill(self, tp: int, tokens: float, context: float) -> float:
        params, _, q_width = self.shape(tp)
        flops = 2 * tokens * params + 2 * tokens * context * q_width * self.cfg.num_layers  # causal: half of 4
        compute = max(params * self.item / self.hw.hbm_bandwidth,
                      flops / (self.hw.matmul_flops * self.hw.matmul_efficiency))
        return compute + float(self.comm(tp, np.asarray(tokens))) + self.hw.step_overhead


# ----- measured tables ------------------------------------------------------------------------------

def _bracket(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index i and weight w with f(x) ~ (1 - w) f[i] + w f[i + 1] (linear extrapolation outside)."""
    if len(grid) == 1:
        return np.zeros(x.shape, dtype=int), np.zeros(x.shape)
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


@dataclass(frozen=True)
class StepTable:
    """Measured seconds per step: ``seconds[i][j]`` at ``batches[i]``, ``contexts[j]``."""

    batches: tuple[float, ...]
    contexts: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name, grid in (("batches", self.batches), ("contexts", self.contexts)):
            if not grid or list(grid) != sorted(set(grid)):
                raise ValueError(f"step table {name} must be increasing and non-empty, got {list(grid)}")
        if len(self.seconds) != len(self.batches) or any(len(r) != len(self.contexts) for r in self.seconds):
            raise ValueError("step table seconds do not match its (batches x contexts) grid")
        if any(not s > 0 for r in self.seconds for s in r):
            raise ValueError("step table seconds must be positive")

    def __call__(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        b, c = np.broadcast_arrays(np.asarray(batch, dtype=np.float64), np.asarray(context, dtype=np.float64))
        grid = np.asarray(self.seconds)
        i, wi = _bracket(np.asarray(self.batches), b)
        j, wj = _bracket(np.asarray(self.contexts), c)
        i1, j1 = np.minimum(i + 1, len(self.batches) - 1), np.minimum(j + 1, len(self.contexts) - 1)
        value = ((1 - wi) * (1 - wj) * grid[i, j] + wi * (1 - wj) * grid[i1, j]
                 + (1 - wi) * wj * grid[i, j1] + wi * wj * grid[i1, j1])
        return np.maximum(value, 0.5 * grid.min())  # extrapolating down never reaches zero


class TableStepTime:
    def __init__(self, tables: dict[int, StepTable], roofline: RooflineStepTime, *, add_comm: bool = False,
                 prefill_per_token: dict[int, float] | None = None):
        self.tables, self.roofline, self.add_comm = dict(tables), roofline, add_comm
        self.prefill_per_token = dict(prefill_per_token or {})

    def decode(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        if tp in self.tables:
            value = self.tables[tp](batch, context)
            return value + self.roofline.comm(tp, batch) if self.add_comm else value
        if not self.tables:
            return self.roofline.decode(tp, batch, context)
        near = min(self.tables, key=lambda t: (abs(t - tp), t))
        ratio = self.decode(near, batch, context) / self.roofline.decode(near, batch, context)
        return self.roofline.decode(tp, batch, context) * ratio

    def prefill(self, tp: int, tokens: float, context: float) -> float:
        if tp in self.prefill_per_token:
            comm = float(self.roofline.comm(tp, np.asarray(tokens))) if self.add_comm else 0.0
            return tokens * self.prefill_per_token[tp] + comm
        return self.roofline.prefill(tp, tokens, context)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "add_comm": self.add_comm,
                "prefill_per_token": {str(tp): s for tp, s in self.prefill_per_token.items()},
                "tables": {str(tp): {"batches": list(t.batches), "contexts": list(t.contexts),
                                     "seconds": [list(r) for r in t.seconds]} for tp, t in self.tables.items()}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, roofline: RooflineStepTime) -> "TableStepTime":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"decode step-time file {path} does not exist")
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ValueError(f"expected format {FORMAT!r}")
            tables = {int(tp): StepTable(tuple(t["batches"]), tuple(t["contexts"]),
                                         tuple(tuple(r) for r in t["seconds"])) for tp, t in raw["tables"].items()}
            prefill = {int(tp): float(s) for tp, s in raw.get("prefill_per_token", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"decode step-time file {path} is malformed: {e}") from None
        return cls(tables, roofline, add_comm=bool(raw.get("add_comm", False)), prefill_per_token=prefill)


class LayerStepTime:
    """``layers x decode_layer(tp, batch, context)`` plus the LM head and the collectives from the
    roofline; ``decode_layer`` is one layer shard's measured time without communication."""

    def __init__(self, decode_layer: Callable[[int, float, float], float], roofline: RooflineStepTime):
        self.decode_layer, self.roofline = np.vectorize(decode_layer, otypes=[float]), roofline

    def decode(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        cfg, hw = self.roofline.cfg, self.roofline.hw
        shard = shard_for(cfg, Layout.contiguous(tp=tp), 0)
        head = shard.vocab_size * cfg.hidden_size * self.roofline.item / hw.hbm_bandwidth
        layers = cfg.num_layers * self.decode_layer(tp, batch, context)
        return layers + head + hw.step_overhead + self.roofline.comm(tp, batch)

    def prefill(self, tp: int, tokens: float, context: float) -> float:
        return self.roofline.prefill(tp, tokens, context)


def load_step_times(path: str, cfg: ModelConfig, dtype_bytes: int) -> tuple[StepTimeModel, Hardware]:
    """The step-time model and hardware rates from ``path`` (a planner profile or measured decode
    steps), or the roofline of an H200 when ``path`` is empty."""
    if not path:
        return RooflineStepTime(cfg, dtype_bytes=dtype_bytes), Hardware()
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"adaptive TP step-time file {file} does not exist")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"adaptive TP step-time file {file} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("format") == PROFILE_FORMAT:
        profile = Profile.from_dict(raw, where=f"profile file {file}")
        cluster = profile.cluster(Cluster())
        hardware = Hardware(hbm_bandwidth=cluster.hbm_bandwidth, matmul_flops=cluster.matmul_flops,
                            bus_bandwidth=cluster.intra_node_bandwidth, p2p_bandwidth=cluster.p2p_bandwidth,
                            collective_latency=cluster.intra_node_latency)
        costs = OpCosts(cluster, profile)
        return LayerStepTime(lambda tp, batch, context: costs.decode_layer(cfg, tp, batch, context),
                             RooflineStepTime(cfg, hardware, dtype_bytes=dtype_bytes)), hardware
    return TableStepTime.load(file, RooflineStepTime(cfg, dtype_bytes=dtype_bytes)), Hardware()
