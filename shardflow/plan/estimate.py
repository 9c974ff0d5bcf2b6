"""Estimate a plan: check memory on every device, cost every call, reallocation and data move,
and simulate the unrolled graph. Plans that do not fit are rejected with the reason.

Memory on a device is what stays there (a trained model's weights, gradients and optimizer state
in its home layout; a frozen model's weights in its call's layout unless offloaded) plus, while a
call runs, what that call adds: a copy of the weights when the call's layout is not the model's
home, activations, and for generation the KV cache (it takes what is left, up to what its requests
need; a cache with fewer slots than requests makes the rest wait).

A trained model's parameters are reallocated from home into a call's layout before the call; after
it the copy is dropped (home still holds the parameters, which only training changes), so the way
back costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shardflow.parallel.layout import Layout
from shardflow.perf.hardware import GB
from shardflow.perf.transfer import data_bytes, data_seconds, realloc_seconds
from shardflow.plan import memory as mem
from shardflow.plan.execution_plan import CallPlan, ExecutionPlan
from shardflow.plan.problem import Choice, Plan, Problem
from shardflow.plan.simulator import SimCall, SimResult, simulate
from shardflow.rl.graph import Call, Kind


@dataclass(frozen=True)
class Estimate:
    feasible: bool
    iteration_s: float  # inf when infeasible
    reason: str = ""  # why it is infeasible
    failed_call: str = ""  # the call that did not fit
    call_s: dict[str, float] = field(default_factory=dict)
    realloc_s: dict[str, float] = field(default_factory=dict)
    data_s: dict[str, float] = field(default_factory=dict)
    kv_slots: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, float] = field(default_factory=dict)  # per call: the fullest device while it runs
    sim: SimResult | None = None


def _index(layout: Layout):
    """The layout's devices as a numpy index (a slice when they form a block)."""
    lo, hi = min(layout.ranks), max(layout.ranks)
    return slice(lo, hi + 1) if hi - lo + 1 == layout.size else np.asarray(layout.ranks)


def _where(layout: Layout) -> str:
    """A layout's shape and rank span, cheap to format for a thousand ranks."""
    lo, hi = min(layout.ranks), max(layout.ranks)
    return f"{layout.shape}@{lo}-{hi}" if hi > lo else f"{layout.shape}@{lo}"


def _fail(call: str, reason: str) -> Estimate:
    return Estimate(False, math.inf, f"{call}{reason}", call)


@dataclass(frozen=True)
class _Placed:
    """One call in its layout: its time, what it adds to a device's memory, its reallocation."""

    seconds: float
    extra_bytes: float
    realloc_s: float | None = None
    kv_slots: int | None = None


def _place(problem: Problem, call: Call, choice: Choice, home: Layout, resident: float) -> _Placed | str:
    """Cost one call next to ``resident`` bytes on its fullest device, or say why it does not fit."""
    p, cluster, costs = problem.precision, problem.cluster, problem.costs
    cfg, layout = problem.models[call.model], choice.layout
    usable = cluster.usable_memory
    extra, realloc = 0.0, None
    if problem.offload.get(call.model, False) and not problem.trained(call.model):
        extra = mem.weight_bytes(cfg, layout, p)  # brought in from CPU memory for the call
        realloc = extra / cluster.host_bandwidth
    elif layout != home:  # a copy reallocated from home, dropped after the call
        extra = mem.weight_bytes(cfg, layout, p)
        realloc = realloc_seconds(cfg, home, layout, cluster, p.param_bytes)
    slots = None
    if call.kind is Kind.GENERATE:
        extra += mem.prefill_activation_bytes(cfg, layout.tp, _prefill_tokens(problem, layout), p)
        extra += mem.decode_copy_bytes(cfg, layout.tp, p, problem.transposed_weights)
        per_slot = mem.kv_bytes_per_slot(cfg, layout.tp, problem.kv_tokens_per_sequence, p)
        longest = mem.kv_bytes_per_slot(cfg, layout.tp, problem.workload.max_tokens, p)  # one must fit
        budget = usable - resident - extra
        if problem.kv_cache_bytes is not None:
            budget = min(budget, problem.kv_cache_bytes)
        wanted = problem.replica_sequences(call, layout)
        slots = min(int(budget // per_slot), wanted) if budget >= longest else 0
        if 1 <= slots < wanted:  # round down to 1/32 steps: fewer distinct cases to cost
            step = max(1, wanted // 32)
            slots = max(1, slots // step * step)
        if slots < 1:
            return (f" in {_where(layout)}: no room for a KV-cache slot ({longest / GB:.2f} GB) next to "
                    f"{(resident + extra) / GB:.1f} GB of {usable / GB:.1f} GB usable")
        extra += slots * per_slot
        seconds = costs.generate(cfg, layout, slots)
    elif call.kind is Kind.INFERENCE:
        tokens = problem.tokens_per_micro_batch(call, layout, choice.micro_batches)
        extra += mem.inference_activation_bytes(cfg, layout, tokens, p)
        seconds = costs.inference(cfg, layout, choice.micro_batches)
    else:
        ckpt = problem.checkpointing.get(call.model, False)
        tokens = problem.tokens_per_micro_batch(call, layout, choice.micro_batches)
        extra += mem.train_activation_bytes(cfg, layout, tokens, choice.micro_batches, ckpt, p)
        seconds = costs.train(cfg, layout, choice.micro_batches, ckpt,
                              sharded=problem.shard_optimizer.get(call.model, False),
                              offloaded=problem.offload_optimizer.get(call.model, False))
    if resident + extra > usable:
        return (f" in {_where(layout)}: needs {(resident + extra) / GB:.1f} GB on a device ({resident / GB:.1f} GB "
                f"resident + {extra / GB:.1f} GB for the call) but {usable / GB:.1f} GB are usable")
    return _Placed(seconds, extra, realloc, slots)


def estimate(problem: Problem, plan: Plan, *, events: bool = False) -> Estimate:
    if len(plan) != len(problem.calls):
        raise ValueError(f"a plan needs {len(problem.calls)} choices, got {len(plan)}")
    p, n = problem.precision, problem.cluster.num_devices
    for call, choice in zip(problem.calls, plan):
        if max(choice.layout.ranks) >= n:
            return _fail(call.name, f" uses device {max(choice.layout.ranks)} but only {n} exist")
    home = {m: plan[problem.index[problem.home_call(m).name]].layout for m in problem.graph.models()}

    resident = np.zeros(n)  # bytes that stay on each device between calls
    for m, layout in home.items():
        if problem.trained(m):
            resident[_index(layout)] += problem.trained_state_bytes(m, layout)
        elif not problem.offload.get(m, False):
            resident[_index(layout)] += mem.weight_bytes(problem.models[m], layout, p)

    placed: dict[str, _Placed] = {}
    peak: dict[str, float] = {}
    data_s: dict[str, float] = {}
    for call, choice in zip(problem.calls, plan):
        base = float(resident[_index(choice.layout)].max())
        outcome = _place(problem, call, choice, home[call.model], base)
        if isinstance(outcome, str):
            return _fail(call.name, outcome)
        placed[call.name] = outcome
        peak[call.name] = base + outcome.extra_bytes
        data_s[call.name] = _data_seconds(problem, plan, call, choice.layout)

    sim_calls = []
    for call in problem.graph.order:
        deps = problem.deps[call.name]
        if call.kind is Kind.FUNCTION:
            sim_calls.append(SimCall(name=call.name, devices=(), seconds=0.0, deps=deps))
            continue
        got = placed[call.name]
        offloaded = problem.offload.get(call.model, False) and not problem.trained(call.model)
        sim_calls.append(SimCall(
            name=call.name, devices=plan[problem.index[call.name]].layout.ranks, seconds=got.seconds, deps=deps,
            model=call.model, trains=call.kind is Kind.TRAIN, data_seconds=data_s[call.name],
            realloc_seconds=got.realloc_s or 0.0, realloc_devices=() if offloaded else home[call.model].ranks,
        ))
    sim = simulate(sim_calls, n, problem.iterations, events=events)
    return Estimate(
        True, sim.iteration_s, "", "",
        call_s={k: v.seconds for k, v in placed.items()},
        realloc_s={k: v.realloc_s for k, v in placed.items() if v.realloc_s is not None},
        data_s=data_s,
        kv_slots={k: v.kv_slots for k, v in placed.items() if v.kv_slots is not None},
        peak_bytes=peak, sim=sim,
    )


def _prefill_tokens(problem: Problem, layout) -> float:
    w = problem.workload
    return math.ceil(w.sequences / layout.dp) * w.prompt_tokens / w.samples_per_prompt


def _data_seconds(problem: Problem, plan: Plan, call: Call, layout) -> float:
    w = problem.workload
    return sum(data_seconds(data_bytes(key, w.sequences, w.mean_tokens), plan[problem.index[holder]].layout,
                            layout, problem.cluster)
               for key, holder in problem.data_inputs[call.name])


# ----- conversion to and from plan files ------------------------------------------------------


def to_execution_plan(problem: Problem, plan: Plan, est: Estimate | None = None,
                      notes: dict | None = None) -> ExecutionPlan:
    calls = {}
    for call, choice in zip(problem.calls, plan):
        seconds = est.call_s.get(call.name) if est is not None and est.feasible else None
        calls[call.name] = CallPlan(layout=choice.layout, micro_batches=choice.micro_batches, estimated_s=seconds)
    return ExecutionPlan(calls, notes or {})


def from_execution_plan(problem: Problem, plan: ExecutionPlan) -> Plan:
    """The search's view of a plan file (micro-batches the runtime would pick where unset)."""
    plan.validate(problem.graph, problem.models, problem.cluster.num_devices)
    out = []
    for call in problem.calls:
        cp = plan[call.name]
        k = cp.micro_batches if call.kind is not Kind.GENERATE else None
        if k is None and call.kind is not Kind.GENERATE:
            k = problem.default_micro_batches(call, cp.layout)
        out.append(Choice(cp.layout, k))
    return tuple(out)
