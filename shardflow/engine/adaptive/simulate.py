"""A generation timeline simulated from known response lengths and a step-time model.

Used to test the switch policy where the right answer is known, and by the benchmark to build
timelines from measured step times where the hardware to run them is missing. It follows the
engine's rules: prompts dealt to replicas round-robin; first come first served admission into free
KV slots (merged replicas queue their waiting requests in submission order); a prefill that yields
each request's first token; one token per request per decode step; replicas decoding independently
and meeting at every decision point (where the generator gathers their state); a switch merging
replicas' requests and their free KV room.
Every figure it produces is a simulation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shardflow.engine.adaptive.kv_migration import regroup_factor
from shardflow.engine.adaptive.merge import plan_merge
from shardflow.engine.adaptive.switch_cost import SwitchCostModel
from shardflow.engine.adaptive.switch_policy import Decider, Loads, bucket_edges, bucket_sums
from shardflow.parallel.layout import Layout
from shardflow.perf.step_time import StepTimeModel


@dataclass(frozen=True)
class SimRequest:
    prompt: int  # prompt tokens
    length: int  # response tokens it will generate (at least 1)


@dataclass
class _Replica:
    active: list[list[int]] = field(default_factory=list)  # [tokens left, context, generated]
    waiting: deque = field(default_factory=deque)  # (submission index, SimRequest)
    clock: float = 0.0


@dataclass
class SimResult:
    seconds: float
    steps: int
    active: list[int]  # active requests (all replicas) at each decode step
    layout_index: list[int]  # index in the chain at each decode step
    switches: list[dict] = field(default_factory=list)  # step, source, target, kv_mode, cost_s, reason


def simulate(requests: Sequence[SimRequest], chain: Sequence[Layout], *, slots: int, steps: StepTimeModel,
             costs: SwitchCostModel, decider: Decider | None = None, schedule: dict[int, Layout] | None = None,
             interval: int = 32, length_buckets: int = 32, kv_mode: str = "auto") -> SimResult:
    """Total seconds to generate ``requests`` starting in ``chain[0]`` with ``slots`` KV slots per
    rank. Switches come from ``decider`` (every ``interval`` steps) or from ``schedule`` (decode
    step -> layout, forced); without either the layout stays. ``steps`` and ``costs`` are the
    simulated truth; the decider may believe other models."""
    cfg = costs.cfg
    layout = chain[0]
    replicas = [_Replica() for _ in range(layout.dp)]
    for i, r in enumerate(requests):
        replicas[i % layout.dp].waiting.append((i, r))
    max_len = max(r.length for r in requests)
    edges = bucket_edges(decider.predictor.max_len if decider else max_len, length_buckets)
    schedule = dict(schedule or {})
    result = SimResult(seconds=0.0, steps=0, active=[], layout_index=[])
    memo: dict[tuple[int, int, int], float] = {}

    def step_seconds(tp: int, batch: int, context: float) -> float:
        key = (tp, batch, int(context) // 16)
        if key not in memo:
            memo[key] = float(steps.decode(tp, np.array([batch]), np.array([key[2] * 16 + 8]))[0])
        return memo[key]

    step = 0
    while True:
        if step % interval == 0 or step in schedule:
            now = max(r.clock for r in replicas)  # replicas meet to exchange their state
            for r in replicas:
                r.clock = now
            if not any(r.active or r.waiting for r in replicas):
                break
            target, reason = schedule.get(step), "forced"
            if target is None and decider is not None and step % interval == 0:
                sums = np.stack([bucket_sums([a[2] for a in r.active] + [0] * len(r.waiting),
                                             [a[1] for a in r.active] + [w.prompt for _, w in r.waiting], edges)
                                 for r in replicas])
                loads = Loads.from_sums(sums[:, 0], sums[:, 1], sums[:, 2])
                decision = decider.decide(layout, loads, [len(r.active) for r in replicas], slots)
                target, reason = decision.target, decision.reason
            if target is not None:
                layout, replicas, slots = _switch(cfg, layout, target, replicas, slots, costs, kv_mode, step,
                                                  reason, result, decider)
        tp = layout.tp
        for r in replicas:
            admitted = []
            while r.waiting and len(r.active) + len(admitted) < slots:
                admitted.append(r.waiting.popleft()[1])
            if admitted:
                tokens = sum(a.prompt for a in admitted)
                r.clock += steps.prefill(tp, tokens, tokens / len(admitted))
                r.active += [[a.length - 1, a.prompt + 1, 1] for a in admitted]
                r.active = [a for a in r.active if a[0] > 0]
        result.active.append(sum(len(r.active) for r in replicas))
        result.layout_index.append(list(chain).index(layout))
        for r in replicas:
            if r.active:
                r.clock += step_seconds(tp, len(r.active), sum(a[1] for a in r.active) / len(r.active))
                for a in r.active:
                    a[0] -= 1
                    a[1] += 1
                    a[2] += 1
                r.active = [a for a in r.active if a[0] > 0]
        step += 1
    result.seconds, result.steps = max(r.clock for r in replicas), step
    return result


def _switch(cfg, layout: Layout, target: Layout, replicas: list[_Replica], slots: int, costs: SwitchCostModel,
            kv_mode: str, step: int, reason: str, result: SimResult, decider: Decider | None):
    merge = plan_merge(layout, target)
    active = [len(r.active) for r in replicas]
    context = [sum(a[1] for a in r.active) / max(len(r.active), 1) for r in replicas]
    modes = decider.allowed_modes(merge, active, slots) if decider else (
        ("migrate", "recompute") if kv_mode == "auto" else (kv_mode,))
    weight_bytes = decider.weight_bytes.get(target, 0) if decider else 0
    cost = costs.estimate(merge, active, context, weight_bytes=weight_bytes, modes=modes)
    if cost is None:
        result.switches.append(dict(step=step, source=str(layout), target=str(target), refused=True, reason=reason))
        return layout, replicas, slots
    merged = []
    for members in merge.groups:
        r = _Replica(clock=replicas[members[0]].clock + cost.total)
        for m in members:
            r.active += replicas[m].active
        r.waiting.extend(sorted((w for m in members for w in replicas[m].waiting), key=lambda w: w[0]))
        merged.append(r)
    result.switches.append(dict(step=step, source=str(layout), target=str(target), kv_mode=cost.kv_mode,
                                cost_s=cost.total, reason=reason))
    return target, merged, (slots + 1) * regroup_factor(cfg, merge) - 1
