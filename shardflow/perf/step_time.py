"""How long one replica's generation step takes, by (tp, active batch, context length): the one
model that the planner and adaptive TP both cost decoding with.

Every model answers numpy arrays (the switch policy asks for many points at once) through one
interface (``decode`` and ``prefill``). Two sources:

- ``OpStepTime``: per-operation costs (``perf.profile.OpCosts``: measured where a profile holds
  the shape, the roofline otherwise) composed as the engine runs a step: every decoder layer's
  step plus two tp all-reduces of its output, the final norm and LM head, and one small
  collective that agrees on the sampled tokens. A prefill is the same with forward passes over
  the prompt tokens. The planner's cost model (``plan.cost``) charges generation with it.
- ``TableStepTime``: whole decode steps measured on a (batch, context) grid per tp (by
  ``bench/adaptive_tp.py``), interpolated bilinearly (decode time is close to affine in both),
  with ``OpStepTime`` for any tp not measured (scaled by the measured/modelled ratio of the
  nearest measured tp). ``add_comm`` adds the modelled collectives to tables measured on one
  GPU without them. Prefill: measured seconds per token per tp where given, else ``OpStepTime``.

``load_step_times`` reads either from a file (``generation.adaptive.step_times``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardflow.config.files import read_json
from shardflow.config.model import ModelConfig
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import FORMAT as PROFILE_FORMAT
from shardflow.perf.profile import OpCosts, Profile
from shardflow.perf.roofline import Roofline

FORMAT = "shardflow-decode-steps/1"


class StepTimeModel(Protocol):
    def decode(self, tp: int, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of one replica of ``batch`` requests of mean length ``context``."""

    def prefill(self, tp: int, tokens: float, context: float) -> float:
        """Seconds to prefill ``tokens`` tokens in sequences of mean length ``context``."""


class OpStepTime:
    """Steps of a replica of ``cfg`` composed from per-operation costs; tp groups never leave a
    node, so their collectives run at the cluster's intra-node rates."""

    def __init__(self, cfg: ModelConfig, ops: OpCosts, *, activation_bytes: int = 2):
        self.cfg, self.ops, self.activation_bytes = cfg, ops, activation_bytes

    @property
    def cluster(self) -> Cluster:
        return self.ops.cluster

    def all_reduce(self, tp: int, tokens: Any) -> Any:
        """One tp all-reduce of ``tokens`` rows of hidden states."""
        return self.ops.all_reduce(tokens * self.cfg.hidden_size * self.activation_bytes, range(tp))

    def comm(self, tp: int, batch: Any) -> np.ndarray:
        """A decode step's collectives: two all-reduces per layer, and one of a row to agree on
        the sampled tokens."""
        batch = np.asarray(batch, dtype=np.float64)
        if tp == 1:
            return np.zeros_like(batch)
        return 2 * self.cfg.num_layers * self.all_reduce(tp, batch) + self.all_reduce(tp, 1)

    def decode(self, tp: int, batch: Any, context: Any) -> np.ndarray:
        batch, context = np.broadcast_arrays(np.asarray(batch, dtype=np.float64),
                                             np.asarray(context, dtype=np.float64))
        layers = self.cfg.num_layers * self.ops.decode_layer(self.cfg, tp, batch, context)
        return layers + self.ops.head_forward(self.cfg, tp, batch) + self.comm(tp, batch)

    def prefill(self, tp: int, tokens: float, context: float, rows: float | None = None) -> float:
        """``tokens`` prompt tokens in sequences of mean length ``context``; the head runs at the
        ``rows`` last positions (default: one per sequence)."""
        rows = tokens / max(context, 1.0) if rows is None else rows
        layer = self.ops.layer_forward(self.cfg, tp, tokens, context) + (2 * self.all_reduce(tp, tokens) if tp > 1 else 0)
        return float(self.cfg.num_layers * layer + self.ops.head_forward(self.cfg, tp, rows))


def roofline_steps(cfg: ModelConfig, cluster: Cluster = Cluster(), *, dtype_bytes: int = 2) -> OpStepTime:
    """Step times from the roofline of ``cluster``'s rates (no profile)."""
    return OpStepTime(cfg, OpCosts(cluster, roofline=Roofline(dtype_bytes=dtype_bytes)), activation_bytes=dtype_bytes)


# ----- measured whole steps -------------------------------------------------------------------------

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
    def __init__(self, tables: dict[int, StepTable], roofline: OpStepTime, *, add_comm: bool = False,
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
    def load(cls, path: str | Path, roofline: OpStepTime) -> "TableStepTime":
        raw = read_json(path, "decode step-time file")
        try:
            if raw.get("format") != FORMAT:
                raise ValueError(f"expected format {FORMAT!r}")
            tables = {int(tp): StepTable(tuple(t["batches"]), tuple(t["contexts"]),
                                         tuple(tuple(r) for r in t["seconds"])) for tp, t in raw["tables"].items()}
            prefill = {int(tp): float(s) for tp, s in raw.get("prefill_per_token", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"decode step-time file {path} is malformed: {e}") from None
        return cls(tables, roofline, add_comm=bool(raw.get("add_comm", False)), prefill_per_token=prefill)


def load_step_times(path: str, cfg: ModelConfig, dtype_bytes: int) -> tuple[StepTimeModel, Cluster]:
    """The step-time model and the rates from ``path`` (a planner profile or measured decode
    steps), or the roofline of the default cluster when ``path`` is empty."""
    cluster = Cluster()
    if not path:
        return roofline_steps(cfg, cluster, dtype_bytes=dtype_bytes), cluster
    file = Path(path)
    raw = read_json(file, "adaptive TP step-time file")
    if isinstance(raw, dict) and raw.get("format") == PROFILE_FORMAT:
        profile = Profile.from_dict(raw, where=f"profile file {file}")
        cluster = profile.cluster(cluster)
        ops = OpCosts(cluster, profile, Roofline(dtype_bytes=dtype_bytes))
        return OpStepTime(cfg, ops, activation_bytes=dtype_bytes), cluster
    return TableStepTime.load(file, roofline_steps(cfg, cluster, dtype_bytes=dtype_bytes)), cluster
