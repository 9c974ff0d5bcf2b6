"""Plans to compare against, built by rule rather than search.

- **symmetric**: every call on all devices in one layout, as DeepSpeed-Chat and OpenRLHF colocate
  (generation folds pp into dp); the best (pp, tp) of that form is taken, with the runtime's own
  micro-batch counts.
- **heuristic**: every call on all devices, each with its own layout picked the way a practitioner
  would: generation with the smallest tp whose KV cache holds all its requests; training with
  Megatron's habit of growing tp inside a node first and then pp, until it fits; inference of a
  trained model in its training layout (no reallocation), of a frozen model with the smallest tp
  that fits.
"""

from __future__ import annotations

from shardflow.parallel.layout import Layout
from shardflow.plan import memory as mem
from shardflow.plan.estimate import Estimate, estimate, from_execution_plan
from shardflow.plan.execution_plan import symmetric_plan
from shardflow.plan.problem import Choice, Plan, Problem
from shardflow.plan.space import splits
from shardflow.rl.graph import Call, Kind


def _valid(problem: Problem, call: Call, layout: Layout) -> bool:
    return splits(problem.models[call.model], layout.pp, layout.tp)


def symmetric(problem: Problem) -> tuple[Plan, Estimate] | None:
    """The fastest feasible symmetric plan, or None when none fits."""
    n = problem.cluster.num_devices
    best: tuple[Plan, Estimate] | None = None
    for tp in (t for t in range(1, problem.cluster.gpus_per_node + 1) if n % t == 0):
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0):
            file_plan = symmetric_plan(problem.graph, n, pp=pp, tp=tp)
            if not all(_valid(problem, c, file_plan[c.name].layout) for c in problem.calls):
                continue
            plan = from_execution_plan(problem, file_plan)
            est = estimate(problem, plan)
            if est.feasible and (best is None or est.iteration_s < best[1].iteration_s):
                best = (plan, est)
    return best


def _ladder(problem: Problem, call: Call) -> list[tuple[int, int]]:
    """(pp, tp) in the order a practitioner tries them: tp up to a node, then pp."""
    n, g = problem.cluster.num_devices, problem.cluster.gpus_per_node
    out = []
    tp = 1
    while tp <= g and n % tp == 0:
        out.append((1, tp))
        tp *= 2
    tp = out[-1][1]
    if call.kind is not Kind.GENERATE:
        pp = 2
        while n % (tp * pp) == 0 and pp <= problem.models[call.model].num_layers:
            out.append((pp, tp))
            pp *= 2
    return [(pp, tp) for pp, tp in out
            if _valid(problem, call, Layout.contiguous(pp=pp, dp=n // (pp * tp), tp=tp))]


def heuristic(problem: Problem) -> tuple[Plan, Estimate] | None:
    """The hand-made plan, or None when no step of its ladder fits."""
    n = problem.cluster.num_devices
    ladders = {c.name: _ladder(problem, c) for c in problem.calls}
    # trained models' inference calls follow their train call (no reallocation)
    follows = {c.name: problem.home_call(c.model).name for c in problem.calls
               if c.kind is Kind.INFERENCE and problem.trained(c.model)}
    level = {name: 0 for name in ladders}
    fallback: tuple[Plan, Estimate] | None = None
    while True:
        plan = []
        for c in problem.calls:
            pp, tp = ladders[follows.get(c.name, c.name)][level[follows.get(c.name, c.name)]]
            if c.kind is Kind.GENERATE:
                pp = 1
            layout = Layout.contiguous(pp=pp, dp=n // (pp * tp), tp=tp)
            plan.append(Choice(layout, problem.default_micro_batches(c, layout)))
        plan = tuple(plan)
        est = estimate(problem, plan)
        if est.feasible:
            short = [c.name for c in problem.calls if c.kind is Kind.GENERATE
                     and est.kv_slots[c.name] < problem.replica_sequences(c, plan[problem.index[c.name]].layout)]
            if fallback is None:
                fallback = (plan, est)
            if not short:
                return plan, est
            bump = short[0]
        else:
            bump = _to_bump(problem, plan, follows.get(est.failed_call, est.failed_call), level, ladders)
        if bump is None or level[bump] + 1 >= len(ladders[bump]):
            return fallback
        level[bump] += 1


def _to_bump(problem: Problem, plan: Plan, failed: str, level: dict[str, int],
             ladders: dict[str, list[tuple[int, int]]]) -> str | None:
    """When what stays on the devices takes more than 60% of their memory, shard the largest
    resident model further first; otherwise the call that failed."""
    p = problem.precision
    resident = {}
    for m in problem.graph.models():
        home = problem.home_call(m).name
        layout = plan[problem.index[home]].layout
        cfg = problem.models[m]
        if problem.trained(m):
            resident[home] = problem.trained_state_bytes(m, layout)
        elif not problem.offload.get(m, False):
            resident[home] = mem.weight_bytes(cfg, layout, p)
    if sum(resident.values()) > 0.6 * problem.cluster.usable_memory:
        open_homes = [h for h in resident if level[h] + 1 < len(ladders[h])]
        if open_homes:
            return max(open_homes, key=lambda h: resident[h])
    return failed if level[failed] + 1 < len(ladders[failed]) else None
