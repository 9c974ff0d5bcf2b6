"""Plan search: Metropolis-Hastings over plans, and exhaustive search where the space is small.

A move changes one call: its devices (any other device set, a neighbouring one, or the set of
another call, so that calls can share devices), its layout on the same devices, or its micro-batch
count. The energy
is the estimated iteration time; a plan that does not fit has infinite energy and is never
accepted. A worse plan is accepted with probability ``exp(-relative slowdown / temperature)``,
so a temperature of 0.05 accepts a plan 5% slower about one time in three.

Several chains start from the baselines and from random feasible plans and take turns, so each
gets an equal share of the time limit. The same seed and step budget give the same plan; a time
limit stops the chains wherever they are.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field

from shardflow.plan.estimate import Estimate, estimate
from shardflow.plan.problem import Plan, Problem
from shardflow.plan.space import Space


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    time_limit_s: float = 60.0
    max_steps: int | None = None  # per chain; None: only the time limit stops
    chains: int = 4
    seed: int = 0
    temperature: float = 0.05

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError(f"search time limit must be positive, got {self.time_limit_s}")
        if self.chains < 1:
            raise ValueError(f"search needs at least one chain, got {self.chains}")
        if self.temperature <= 0:
            raise ValueError(f"search temperature must be positive, got {self.temperature}")


@dataclass
class SearchResult:
    plan: Plan
    estimate: Estimate
    steps: int = 0  # proposals evaluated, all chains
    accepted: int = 0
    accepted_worse: int = 0
    seconds: float = 0.0
    evaluated: int = 0  # distinct plans estimated
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, best) at each improvement


class Evaluator:
    """Estimates plans, remembering iteration times of plans seen before."""

    def __init__(self, problem: Problem, limit: int = 200_000):
        self.problem, self.limit = problem, limit
        self.seen: dict[Plan, float] = {}

    def __call__(self, plan: Plan) -> float:
        t = self.seen.get(plan)
        if t is None:
            if len(self.seen) >= self.limit:
                self.seen.clear()
            t = self.seen[plan] = estimate(self.problem, plan).iteration_s
        return t


def propose(space: Space, plan: Plan, rng: random.Random) -> Plan:
    calls = space.problem.calls
    i = rng.randrange(len(calls))
    call, current = calls[i], plan[i]
    start, size = min(current.layout.ranks), current.layout.size
    move = rng.random()
    if move < 0.15:  # other devices anywhere, keeping tp and pp where they fit
        start, size = space.random_set(call, rng)
        choice = space.random_on(call, start, size, rng, keep=current)
    elif move < 0.3:  # devices next to the current ones
        start, size = space.nearby_set(call, start, size, rng)
        choice = space.random_on(call, start, size, rng, keep=current)
    elif move < 0.45 and len(calls) > 1:  # share another call's devices
        other = plan[rng.choice([j for j in range(len(calls)) if j != i])].layout
        choice = space.random_on(call, min(other.ranks), other.size, rng, keep=current)
    elif move < 0.85:  # another layout on the same devices
        choice = space.random_on(call, start, size, rng)
    else:  # another micro-batch count
        options = space.micro_options(call, current.layout)
        choice = type(current)(current.layout, rng.choice(options))
    if choice is None:
        return plan
    return plan[:i] + (choice,) + plan[i + 1:]


def random_feasible(space: Space, evaluate: Evaluator, rng: random.Random, tries: int = 200) -> Plan | None:
    for _ in range(tries):
        plan = tuple(space.random_choice(c, rng) for c in space.problem.calls)
        if math.isfinite(evaluate(plan)):
            return plan
    return None


def mcmc(space: Space, starts: list[Plan], options: SearchOptions = SearchOptions()) -> SearchResult:
    """Metropolis-Hastings from ``starts`` (cycled over the chains; chains without a start begin
    from a random feasible plan)."""
    problem = space.problem
    evaluate = Evaluator(problem)
    t0 = time.perf_counter()
    chains: list[tuple[random.Random, Plan, float]] = []
    for c in range(options.chains):
        rng = random.Random(options.seed * 1_000_003 + c)
        feasible = [p for p in starts if math.isfinite(evaluate(p))]
        plan = feasible[c % len(feasible)] if c < len(feasible) else random_feasible(space, evaluate, rng)
        if plan is None and feasible:
            plan = feasible[c % len(feasible)]
        if plan is not None:
            chains.append((rng, plan, evaluate(plan)))
    if not chains:
        raise ValueError("no feasible plan found to start the search from: every baseline and random plan "
                         "exceeds device memory")
    best_plan, best = min(((p, e) for _, p, e in chains), key=lambda pe: pe[1])
    result = SearchResult(best_plan, None, history=[(0, best)])
    while True:
        if time.perf_counter() - t0 >= options.time_limit_s:
            break
        if options.max_steps is not None and result.steps >= options.max_steps * len(chains):
            break
        for c, (rng, plan, energy) in enumerate(chains):
            candidate = propose(space, plan, rng)
            e = evaluate(candidate)
            result.steps += 1
            if not math.isfinite(e):
                continue
            worse = (e - energy) / energy
            if worse <= 0 or rng.random() < math.exp(-worse / options.temperature):
                result.accepted += 1
                result.accepted_worse += worse > 0
                chains[c] = (rng, candidate, e)
                if e < best:
                    best_plan, best = candidate, e
                    result.history.append((result.steps, best))
    result.plan = best_plan
    result.estimate = estimate(problem, best_plan, events=True)
    result.seconds = time.perf_counter() - t0
    result.evaluated = len(evaluate.seen)
    return result


def exhaustive(space: Space, max_plans: int = 200_000) -> SearchResult:
    """Estimate every plan of the space (refused when it holds more than ``max_plans``)."""
    count = space.count()
    if count > max_plans:
        raise ValueError(f"the plan space holds {count} plans, more than the {max_plans} exhaustive search "
                         "is allowed; use the MCMC search")
    problem = space.problem
    t0 = time.perf_counter()
    per_call = [space.choices(c) for c in problem.calls]
    best_plan, best = None, math.inf
    steps = 0
    for plan in itertools.product(*per_call):
        steps += 1
        e = estimate(problem, plan).iteration_s
        if e < best:
            best_plan, best = plan, e
    if best_plan is None:
        raise ValueError("no plan in the space fits in device memory")
    return SearchResult(best_plan, estimate(problem, best_plan, events=True), steps=steps,
                        seconds=time.perf_counter() - t0, evaluated=steps)
