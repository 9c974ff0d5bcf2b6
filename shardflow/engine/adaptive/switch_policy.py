"""When to switch: remaining generation time in the current layout against each merged layout.

Pure functions of shared information, so that the rank deciding and any test see the same thing.
The unfinished requests of each replica are summarised in a fixed number of buckets by tokens
generated (``bucket_loads``), so a decision costs the same for 8 requests or 8,000:
O(replicas x buckets x grid points + candidates x switch times x grid points).

For each future step t on a geometric grid the length predictor gives, per bucket, the
probability that its requests are still running. From it, per replica of a layout: the expected
active batch while it is busy and the probability that it is busy; the layout's expected time per
step is P(some request is left) x the slowest busy replica's step time (a layout runs until its
last request ends; replicas decode in parallel). Summing over the grid gives the remaining time
of a layout from any grid point on.

Backwards over the grid, the best remaining time in each layout of the chain allows switching on
to any later layout at the first ``switch_points`` grid points (the switch cost computed with the
requests and contexts expected then), so a plan may hold several switches (d4t1 -> d2t2 -> d1t4).
The decision switches now to the best candidate when that beats every plan that does not switch
now (a better later switch means waiting) and its saving over never switching exceeds the switch
cost by ``margin`` (saving - cost >= margin x cost + min_saving_s). Later switches are decided
again at later decision points, from the new layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from shardflow.config.experiment import AdaptiveConfig
from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.kv_migration import KV_MODES, fit_problem
from shardflow.engine.adaptive.length_predictor import LengthPredictor
from shardflow.engine.adaptive.merge import Merge, plan_merge
from shardflow.engine.adaptive.switch_cost import SwitchCost, SwitchCostModel
from shardflow.parallel.layout import Layout
from shardflow.perf.step_time import StepTimeModel

# cost(merge, active [R], context [R], now) -> cost of switching with that many requests of that
# mean context per replica of the current layout, or None if it cannot be done (``now``: at once,
# so that the caches' room counts).
CostFn = Callable[[Merge, np.ndarray, np.ndarray, bool], "SwitchCost | None"]


@dataclass(frozen=True)
class Loads:
    """Unfinished requests of each replica of the current layout, bucketed by tokens generated."""

    counts: np.ndarray  # [R, G]
    generated: np.ndarray  # [R, G] mean tokens generated in the bucket
    context: np.ndarray  # [R, G] mean prompt + generated tokens in the bucket

    @classmethod
    def from_sums(cls, counts: np.ndarray, generated_sum: np.ndarray, context_sum: np.ndarray) -> "Loads":
        counts = np.asarray(counts, dtype=np.float64)
        safe = np.maximum(counts, 1)
        return cls(counts, np.asarray(generated_sum) / safe, np.asarray(context_sum) / safe)


def bucket_edges(max_len: int, buckets: int) -> np.ndarray:
    """Lower edges of the generated-token buckets: 0, then geometric up to ``max_len``."""
    return np.unique(np.concatenate([[0], np.round(np.geomspace(1, max(max_len, 2), buckets - 1))]))


def bucket_sums(generated: Sequence[int], context: Sequence[int], edges: np.ndarray) -> np.ndarray:
    """[3, G]: count, sum of generated tokens, sum of contexts per bucket (sums add across ranks)."""
    out = np.zeros((3, len(edges)))
    if len(generated):
        index = np.searchsorted(edges, np.asarray(generated), side="right") - 1
        np.add.at(out[0], index, 1)
        np.add.at(out[1], index, np.asarray(generated, dtype=np.float64))
        np.add.at(out[2], index, np.asarray(context, dtype=np.float64))
    return out


@dataclass(frozen=True, kw_only=True)
class Decision:
    target: Layout | None
    kv_mode: str | None = None
    stay_s: float = 0.0  # predicted remaining time without switching
    switch_s: float | None = None  # predicted remaining time switching to the target now, cost included
    cost: SwitchCost | None = None
    reason: str = ""

    @property
    def saving_s(self) -> float | None:
        return None if self.switch_s is None else self.stay_s - self.switch_s + (self.cost.total if self.cost else 0.0)


def decide(*, layout: Layout, candidates: Sequence[Merge], loads: Loads, predictor: LengthPredictor,
           steps: StepTimeModel, cost: CostFn, config: AdaptiveConfig) -> Decision:
    """``candidates``: merges from ``layout`` to the later layouts of the chain, in chain order."""
    rep, b = np.nonzero(loads.counts)
    if len(rep) == 0:
        return Decision(target=None, reason="no unfinished requests")
    count, gen, ctx = loads.counts[rep, b], loads.generated[rep, b], loads.context[rep, b]
    horizon = max(predictor.max_len - gen.min(), 1.0)
    t = np.unique(np.concatenate([[0.0], np.round(np.geomspace(min(config.interval, horizon), horizon,
                                                              config.horizon_points - 1))]))
    alive = predictor.still_running(gen, t)  # [K, J]
    replicas = loads.counts.shape[0]
    n = np.zeros((replicas, len(t)))  # expected requests still running, per current replica
    np.add.at(n, rep, count[:, None] * alive)
    log_idle = np.zeros_like(n)
    np.add.at(log_idle, rep, count[:, None] * np.log1p(-np.minimum(alive, 1 - 1e-12)))
    tokens = np.zeros_like(n)  # their expected context tokens
    np.add.at(tokens, rep, count[:, None] * alive * (ctx[:, None] + t[None, :]))
    some_left = 1 - np.exp(log_idle.sum(0))  # [J]
    fallback_ctx = float(ctx.mean()) + t

    chain = [layout] + [m.dst for m in candidates]
    groups = {layout: [[r] for r in range(replicas)], **{m.dst: [list(g) for g in m.groups] for m in candidates}}

    def segments(target: Layout) -> np.ndarray:
        """[J - 1] expected seconds between grid points in ``target`` (trapezoid rule)."""
        slowest = np.zeros(len(t))
        for members in groups[target]:
            nq = n[members].sum(0)
            busy = 1 - np.exp(log_idle[members].sum(0))
            batch = np.maximum(nq / np.maximum(busy, 1e-12), 1.0)
            context = np.where(nq > 1e-9, tokens[members].sum(0) / np.maximum(nq, 1e-12), fallback_ctx)
            slowest = np.maximum(slowest, np.where(busy > 1e-9, steps.decode(target.tp, batch, context), 0.0))
        per = some_left * slowest
        return (per[:-1] + per[1:]) / 2 * np.diff(t)

    def switch_cost(source: Layout, target: Layout, j: int) -> SwitchCost | None:
        """Cost of switching ``source`` -> ``target`` at grid point j, with the requests expected then."""
        active = np.array([n[g, j].sum() for g in groups[source]])
        held = np.array([tokens[g, j].sum() for g in groups[source]])
        context = np.divide(held, active, out=np.full(len(active), fallback_ctx[j]), where=active > 1e-9)
        return cost(plan_merge(source, target), active, context, source == layout and j == 0)

    # Best remaining time from grid point j in each layout, switching onwards at the first
    # ``switch_points`` grid points (backwards over the grid; the chain only ever moves forward).
    best: dict[Layout, np.ndarray] = {}
    for index in range(len(chain) - 1, -1, -1):
        here, seg = chain[index], segments(chain[index])
        value = np.zeros(len(t))
        for j in range(len(t) - 2, -1, -1):
            value[j] = seg[j] + value[j + 1]
            if j >= config.switch_points or (here == layout and j == 0):
                continue
            for target in chain[index + 1:]:
                c = switch_cost(here, target, j)
                if c is not None:
                    value[j] = min(value[j], c.total + best[target][j])
        best[here] = value
    never = float(segments(layout).sum())
    waiting = float(best[layout][0])  # not switching now, maybe later
    now = [(c.total + float(best[m.dst][0]), m.dst, c) for m in candidates
           if (c := switch_cost(layout, m.dst, 0)) is not None]
    if not now:
        return Decision(target=None, stay_s=never, reason="no candidate layout can be switched to now")
    total, target, c = min(now, key=lambda x: x[0])
    decision = dict(stay_s=never, switch_s=total, cost=c, kv_mode=c.kv_mode)
    if waiting <= total:
        return Decision(target=None, **decision, reason=f"waiting is predicted {total - waiting:.3g}s better "
                        f"than switching to {target} now")
    if never - total < config.margin * c.total + config.min_saving_s:
        return Decision(target=None, **decision, reason=f"switching to {target} saves {never - total + c.total:.3g}s, "
                        f"which does not pay for the switch ({c.total:.3g}s) with margin {config.margin}")
    return Decision(target=target, **decision, reason=f"switching to {target} saves {never - total + c.total:.3g}s "
                    f"for a switch of {c.total:.3g}s")


class Decider:
    """What stays fixed through a generation around ``decide``: the layouts it may switch to (later
    layouts of the chain), the cost model, which KV modes are allowed and what fits in the caches."""

    def __init__(self, *, cfg: ModelConfig, chain: Sequence[Layout], steps: StepTimeModel, costs: SwitchCostModel,
                 predictor: LengthPredictor, config: AdaptiveConfig, kv_mode: str = "auto",
                 weight_bytes: dict[Layout, int] | None = None):
        if kv_mode not in ("auto", *KV_MODES):
            raise ValueError(f"kv_mode must be auto, {' or '.join(KV_MODES)}; got {kv_mode!r}")
        self.cfg, self.chain, self.steps, self.costs = cfg, list(chain), steps, costs
        self.predictor, self.config, self.kv_mode = predictor, config, kv_mode
        self.weight_bytes = weight_bytes or {}

    def modes(self) -> tuple[str, ...]:
        return KV_MODES if self.kv_mode == "auto" else (self.kv_mode,)

    def allowed_modes(self, merge: Merge, active: Sequence[int], slots: int) -> tuple[str, ...]:
        """KV modes that fit the caches for a switch now, among those configured."""
        return tuple(m for m in self.modes() if fit_problem(self.cfg, merge, active, slots, m) is None)

    def candidates(self, layout: Layout) -> list[Merge]:
        later = self.chain[self.chain.index(layout) + 1:] if layout in self.chain else []
        return [plan_merge(layout, target) for target in later]

    def decide(self, layout: Layout, loads: Loads, active: Sequence[int], slots: int,
               new_graphs: Callable[[Layout, float], int] = lambda layout, batch: 0) -> Decision:
        """``loads``: every unfinished request per replica (waiting ones as 0 tokens generated);
        ``active``: requests holding KV slots per replica; ``slots``: KV slots of every rank's cache
        view in ``layout``; ``new_graphs(layout, batch)``: decode graphs a switch to ``layout``
        with that batch would capture."""
        active_now = list(active)
        candidates = self.candidates(layout)
        if not candidates:
            return Decision(target=None, reason=f"no layout to switch to after {layout}")

        def cost(merge: Merge, active: np.ndarray, context: np.ndarray, now: bool):
            modes = self.allowed_modes(merge, active_now, slots) if now else self.modes()
            batch = max((sum(active[m] for m in g) for g in merge.groups), default=0.0)
            return self.costs.estimate(merge, active, context, weight_bytes=self.weight_bytes.get(merge.dst, 0),
                                       new_graphs=new_graphs(merge.dst, batch), modes=modes)

        return decide(layout=layout, candidates=candidates, loads=loads, predictor=self.predictor,
                      steps=self.steps, cost=cost, config=self.config)
