"""Profile files (what ``shardflow profile`` measured) and per-operation costs built on them.

A profile is JSON:

    {"format": "shardflow-profile/1", "device": "<GPU name>",
     "rates": {"matmul_flops": 7.9e14, "hbm_bandwidth": 4.3e12, ...},   # Cluster fields measured
     "layers": {"<layer key>": {"<tp>": {"forward":  {"x": tokens, "y": seqlens, "seconds": [[...]]},
                                         "backward": {...},
                                         "decode":   {"x": batches, "y": contexts, "seconds": [[...]]},
                                         "optimizer_per_param": 1.2e-11,
                                         "attention_forward": {...}, "attention_backward": {...},
                                         "packed_forward": {...}, "packed_backward": {...}}}},
     "heads":  {"<head key>":  {"<tp>": {"forward": {"x": tokens, "seconds": [...]}, "backward": {...}}}}}

The attention tables (tokens, seqlens) time the layer's causal attention alone, the packed ones
(key slots, row lengths) the packed-sequence attention that shared prompts run instead
(``models.packed_attention``): the cost model swaps one for the other. Profiles without them
(older files) get both from the roofline.

Times are for one tensor-parallel shard on one GPU, without communication (collectives are
costed from the cluster's link rates). ``OpCosts`` answers each operation from the profile when
it holds that shape and tp; from the roofline scaled by the measured/roofline ratio of the nearest
profiled tp when it holds the shape only; and from the plain roofline otherwise.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shardflow.config.files import read_json
from shardflow.config.model import ModelConfig
from shardflow.perf.hardware import Cluster
from shardflow.perf.roofline import Roofline, head_shape, layer_shape

FORMAT = "shardflow-profile/1"


def _interp(xs: tuple[float, ...], x: float) -> tuple[int, float]:
    """Bracket index i and weight w so that f(x) ~ (1 - w) f[i] + w f[i + 1]: clamped below the
    first point (launch-bound sizes cost what the smallest measured one did), extrapolated
    linearly past the last one (work keeps growing)."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class Table:
    """Seconds measured on a grid: ``seconds[i]`` at ``x[i]`` (1-D) or ``seconds[i][j]`` at
    ``(x[i], y[j])`` (2-D), interpolated linearly (see ``_interp``)."""

    x: tuple[float, ...]
    seconds: tuple
    y: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.x or list(self.x) != sorted(set(self.x)):
            raise ValueError(f"profile table x must be increasing and non-empty, got {self.x}")
        if self.y is not None and (not self.y or list(self.y) != sorted(set(self.y))):
            raise ValueError(f"profile table y must be increasing and non-empty, got {self.y}")
        rows = self.seconds
        if len(rows) != len(self.x) or (self.y is not None and any(len(r) != len(self.y) for r in rows)):
            raise ValueError("profile table seconds do not match its grid")
        # interpolation never goes below a quarter of the fastest measurement (no negative times)
        object.__setattr__(self, "_floor", 0.25 * min(_flat(rows)))

    def _row(self, row: Any, y: float | None) -> float:
        if self.y is None:
            return row
        j, w = _interp(self.y, y)
        return row[j] if len(self.y) == 1 else (1 - w) * row[j] + w * row[j + 1]

    def __call__(self, x: Any, y: Any = None) -> Any:
        """Seconds at ``x`` (and ``y``); numpy arrays give an array."""
        if np.ndim(x) or np.ndim(y):
            return np.vectorize(self._at, otypes=[float])(x, y)
        return self._at(x, y)

    def _at(self, x: float, y: float | None) -> float:
        i, w = _interp(self.x, x)
        lo = self._row(self.seconds[i], y)
        if len(self.x) == 1:
            return lo
        value = (1 - w) * lo + w * self._row(self.seconds[i + 1], y)
        return max(value, self._floor)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"x": list(self.x)}
        if self.y is not None:
            out["y"] = list(self.y)
        out["seconds"] = [list(r) if isinstance(r, (list, tuple)) else r for r in self.seconds]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Table":
        y = raw.get("y")
        seconds = tuple(tuple(float(v) for v in r) if y is not None else float(r) for r in raw["seconds"])
        return cls(tuple(float(v) for v in raw["x"]), seconds, None if y is None else tuple(float(v) for v in y))


def _flat(rows: tuple) -> list[float]:
    return [v for r in rows for v in (r if isinstance(r, tuple) else (r,))]


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    forward: Table  # (tokens, seqlen)
    backward: Table  # (tokens, seqlen)
    decode: Table  # (batch, context)
    optimizer_per_param: float
    attention_forward: Table | None = None  # (tokens, seqlen): causal attention alone
    attention_backward: Table | None = None
    packed_forward: Table | None = None  # (key slots, row length): packed-sequence attention
    packed_backward: Table | None = None


@dataclass(frozen=True, kw_only=True)
class HeadProfile:
    forward: Table  # tokens
    backward: Table


_LAYER_TABLES = ("forward", "backward", "decode")
_OPTIONAL_TABLES = ("attention_forward", "attention_backward", "packed_forward", "packed_backward")


def _layer_dict(p: LayerProfile) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(p, name).to_dict() for name in _LAYER_TABLES}
    out["optimizer_per_param"] = p.optimizer_per_param
    out.update({name: getattr(p, name).to_dict() for name in _OPTIONAL_TABLES if getattr(p, name) is not None})
    return out


def _layer_from_dict(raw: dict[str, Any]) -> LayerProfile:
    tables = {name: Table.from_dict(raw[name]) for name in _LAYER_TABLES}
    tables.update({name: Table.from_dict(raw[name]) for name in _OPTIONAL_TABLES if name in raw})
    return LayerProfile(**tables, optimizer_per_param=float(raw["optimizer_per_param"]))


def layer_key(cfg: ModelConfig) -> str:
    """What a decoder layer's cost depends on (not the layer count or vocabulary)."""
    flags = "".join(f"-{n}" for n in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm") if getattr(cfg, n))
    return (f"h{cfg.hidden_size}-i{cfg.intermediate_size}-q{cfg.num_heads}-kv{cfg.num_kv_heads}"
            f"-d{cfg.head_dim}{flags}")


def head_key(cfg: ModelConfig) -> str:
    return f"h{cfg.hidden_size}-value" if cfg.value_head else f"h{cfg.hidden_size}-v{cfg.vocab_size}"


@dataclass(kw_only=True)
class Profile:
    device: str = "unknown"
    rates: dict[str, float] = field(default_factory=dict)  # Cluster field -> measured value
    layers: dict[str, dict[int, LayerProfile]] = field(default_factory=dict)
    heads: dict[str, dict[int, HeadProfile]] = field(default_factory=dict)

    def cluster(self, base: Cluster) -> Cluster:
        """``base`` with the rates this profile measured."""
        return base.with_rates(**self.rates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "device": self.device,
            "rates": dict(self.rates),
            "layers": {k: {str(tp): _layer_dict(p) for tp, p in by_tp.items()} for k, by_tp in self.layers.items()},
            "heads": {k: {str(tp): {"forward": p.forward.to_dict(), "backward": p.backward.to_dict()}
                          for tp, p in by_tp.items()} for k, by_tp in self.heads.items()},
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "profile") -> "Profile":
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"{where} is not a shardflow profile (expected format {FORMAT!r})")
        known = set(Cluster.__dataclass_fields__)
        unknown = set(raw.get("rates", {})) - known
        if unknown:
            raise ValueError(f"{where} has unknown rates {sorted(unknown)}")
        try:
            layers = {k: {int(tp): _layer_from_dict(p) for tp, p in by_tp.items()}
                      for k, by_tp in raw.get("layers", {}).items()}
            heads = {k: {int(tp): HeadProfile(forward=Table.from_dict(p["forward"]),
                                              backward=Table.from_dict(p["backward"]))
                         for tp, p in by_tp.items()} for k, by_tp in raw.get("heads", {}).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} is malformed: {e!r}") from None
        return cls(device=str(raw.get("device", "unknown")), rates={k: float(v) for k, v in raw.get("rates", {}).items()},
                   layers=layers, heads=heads)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_dict(read_json(path, "profile file"), where=f"profile file {path}")


class OpCosts:
    """Seconds of one operation on one GPU's shard: measured, calibrated roofline, or roofline."""

    def __init__(self, cluster: Cluster, profile: Profile | None = None, roofline: Roofline = Roofline()):
        self.cluster = cluster
        self.profile = profile or Profile()
        self.roofline = roofline

    def source(self, cfg: ModelConfig, tp: int) -> str:
        """'measured', 'calibrated' (roofline scaled by another tp's measurement) or 'roofline'."""
        by_tp = self.profile.layers.get(layer_key(cfg), {})
        return "measured" if tp in by_tp else "calibrated" if by_tp else "roofline"

    def _pick(self, table: dict[int, Any], tp: int, get: Callable[[Any], float],
              roof: Callable[[int], float]) -> float:
        if tp in table:
            return get(table[tp])
        if not table:
            return roof(tp)
        near = min(table, key=lambda t: (abs(t - tp), t))
        return roof(tp) * get(table[near]) / roof(near)

    def layer_forward(self, cfg: ModelConfig, tp: int, tokens: float, seqlen: float) -> float:
        return self._pick(self.profile.layers.get(layer_key(cfg), {}), tp, lambda p: p.forward(tokens, seqlen),
                          lambda t: self.roofline.layer_forward(layer_shape(cfg, t), self.cluster, tokens, seqlen))

    def layer_backward(self, cfg: ModelConfig, tp: int, tokens: float, seqlen: float) -> float:
        return self._pick(self.profile.layers.get(layer_key(cfg), {}), tp, lambda p: p.backward(tokens, seqlen),
                          lambda t: self.roofline.layer_backward(layer_shape(cfg, t), self.cluster, tokens, seqlen))

    def packed_layer_forward(self, cfg: ModelConfig, tp: int, tokens: float, slots: float, seqlen: float) -> float:
        """Forward of ``tokens`` packed tokens (a shared prompt once) whose attention runs over rows
        of ``slots`` key slots (``models.packed_attention``): the layer at its tokens, with its causal
        attention swapped for the packed one."""
        return (self.layer_forward(cfg, tp, tokens, seqlen) - self._attention(cfg, tp, "attention_forward", tokens, seqlen)
                + self._attention(cfg, tp, "packed_forward", slots, seqlen))

    def packed_layer_backward(self, cfg: ModelConfig, tp: int, tokens: float, slots: float, seqlen: float) -> float:
        return (self.layer_backward(cfg, tp, tokens, seqlen)
                - self._attention(cfg, tp, "attention_backward", tokens, seqlen)
                + self._attention(cfg, tp, "packed_backward", slots, seqlen))

    def _attention(self, cfg: ModelConfig, tp: int, kind: str, x: float, seqlen: float) -> float:
        """One of the layer's attention tables (``kind``: a ``LayerProfile`` field) at ``(x, seqlen)``;
        the roofline's where the profile lacks it."""
        by_tp = {t: p for t, p in self.profile.layers.get(layer_key(cfg), {}).items() if getattr(p, kind) is not None}
        return self._pick(by_tp, tp, lambda p: getattr(p, kind)(x, seqlen),
                          lambda t: getattr(self.roofline, kind)(layer_shape(cfg, t), self.cluster, x, seqlen))

    def decode_layer(self, cfg: ModelConfig, tp: int, batch: float, context: float) -> float:
        return self._pick(self.profile.layers.get(layer_key(cfg), {}), tp, lambda p: p.decode(batch, context),
                          lambda t: self.roofline.decode_layer(layer_shape(cfg, t), self.cluster, batch, context))

    def head_forward(self, cfg: ModelConfig, tp: int, tokens: float) -> float:
        return self._pick(self.profile.heads.get(head_key(cfg), {}), tp, lambda p: p.forward(tokens),
                          lambda t: self.roofline.head_forward(head_shape(cfg, t), self.cluster, tokens))

    def head_backward(self, cfg: ModelConfig, tp: int, tokens: float) -> float:
        return self._pick(self.profile.heads.get(head_key(cfg), {}), tp, lambda p: p.backward(tokens),
                          lambda t: self.roofline.head_backward(head_shape(cfg, t), self.cluster, tokens))

    def optimizer(self, cfg: ModelConfig, tp: int, params: float) -> float:
        by_tp = self.profile.layers.get(layer_key(cfg), {})
        if by_tp:  # memory-bound: seconds per parameter barely depend on the shard shape
            near = min(by_tp, key=lambda t: (abs(t - tp), t))
            return params * by_tp[near].optimizer_per_param
        return self.roofline.optimizer(self.cluster, params)

    def grad_accumulate(self, cfg: ModelConfig, tp: int, params: float) -> float:
        """One micro-batch's weight gradients added into the float32 buffer (memory-bound)."""
        return self.roofline.grad_accumulate(self.cluster, params)

    # ----- communication (from the cluster's link rates) --------------------------------------

    def all_reduce(self, nbytes: float, ranks: tuple[int, ...] | range) -> float:
        """Ring all-reduce: each rank moves 2 (n - 1) / n of the buffer over the bus bandwidth."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        return self.cluster.latency(ranks) + 2 * (n - 1) / n * nbytes / self.cluster.bus_bandwidth(ranks)

    def p2p(self, nbytes: float, src: int, dst: int) -> float:
        c = self.cluster
        if c.node_of(src) == c.node_of(dst):
            return c.intra_node_latency + nbytes / c.p2p_bandwidth
        return c.inter_node_latency + nbytes / c.inter_node_bandwidth
