"""``shardflow plan CONFIG.yaml``: search an execution plan for an experiment on a cluster.

It prints the calls with their estimated times next to the symmetric and heuristic baselines,
writes ``plan.yaml`` (which ``shardflow train`` runs unchanged) and draws the plan as ``plan.png``.
A simulated cluster is fine: model directories holding only ``config.json`` are enough.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from shardflow.config.load import load_config
from shardflow.parallel.layout import format_ranks
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import Profile
from shardflow.plan.baselines import heuristic, symmetric
from shardflow.plan.estimate import Estimate, to_execution_plan
from shardflow.plan.problem import Plan, Problem, describe_models, problem_from_config
from shardflow.plan.search import SearchOptions, SearchResult, exhaustive, mcmc
from shardflow.plan.space import Space
from shardflow.plan.timeline import draw_timeline
from shardflow.runtime.validate import check_config

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--devices", type=int, help="GPUs to plan for (default: run.devices)")
    where.add_argument("--nodes", type=int, help="nodes to plan for (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--time-limit", type=float, default=60.0, help="search time limit in seconds")
    p.add_argument("--max-steps", type=int, default=None, help="proposals per chain (reproducible stop)")
    p.add_argument("--chains", type=int, default=4, help="MCMC chains")
    p.add_argument("--seed", type=int, default=0, help="search seed")
    p.add_argument("--temperature", type=float, default=0.05, help="MCMC temperature (relative slowdown)")
    p.add_argument("--exhaustive", action="store_true", help="estimate every plan (small spaces only)")
    p.add_argument("--profile", help="profile JSON from 'shardflow profile' (default: roofline)")
    p.add_argument("--out", help="directory for plan.yaml and plan.png (default: the run's out_dir)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default: data.max_prompt_tokens)")
    p.add_argument("--response-mean", type=float, help="mean response length (default: max_new_tokens / 2)")
    p.add_argument("--response-std", type=float, help="response length spread (default: max_new_tokens / 4)")
    p.add_argument("--iterations", type=int, default=3, help="iterations the simulator unrolls")


def run(args: argparse.Namespace) -> None:
    options = SearchOptions(time_limit_s=args.time_limit, max_steps=args.max_steps, chains=args.chains,
                            seed=args.seed, temperature=args.temperature)
    plan_experiment(args.config, args.overrides, devices=args.devices, nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node, out=args.out, profile=args.profile, options=options,
                    use_exhaustive=args.exhaustive, prompt_tokens=args.prompt_tokens,
                    response_mean=args.response_mean, response_std=args.response_std, iterations=args.iterations)


@dataclass
class PlanOutcome:
    problem: Problem
    result: SearchResult
    baselines: dict[str, tuple[Plan, Estimate] | None]
    plan_file: Path
    picture: Path


def plan_experiment(config_path: str, overrides: list[str] = (), *, devices: int | None = None,
                    nodes: int | None = None, gpus_per_node: int = 8, out: str | None = None,
                    profile: str | None = None, options: SearchOptions = SearchOptions(),
                    use_exhaustive: bool = False, prompt_tokens: int | None = None,
                    response_mean: float | None = None, response_std: float | None = None,
                    iterations: int = 3) -> PlanOutcome:
    config = check_config(load_config(config_path, list(overrides))).config
    if devices is None and nodes is None:
        devices = config.run.devices
    cluster = Cluster.for_devices(devices, nodes=nodes, gpus_per_node=gpus_per_node)
    prof = Profile.load(profile) if profile else None
    problem = problem_from_config(config, cluster, profile=prof,
                                  prompt_tokens=prompt_tokens, response_mean=response_mean,
                                  response_std=response_std, iterations=iterations)
    space = Space(problem)
    logger.info(f"cluster: {problem.cluster.describe()}" + (f" (profile of {prof.device})" if prof else " (roofline)"))
    logger.info(f"workload: {problem.workload.describe()}")
    for line in describe_models(problem):
        logger.info(f"model {line}")

    baselines = {"symmetric": symmetric(problem), "heuristic": heuristic(problem)}
    if use_exhaustive:
        result = exhaustive(space)
    else:
        starts = [b[0] for b in baselines.values() if b is not None]
        result = mcmc(space, starts, options)

    out_dir = Path(out) if out else config.run.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = {
        "estimated_iteration_s": round(result.estimate.iteration_s, 4),
        "baselines_s": {k: (round(v[1].iteration_s, 4) if v else None) for k, v in baselines.items()},
        "cluster": problem.cluster.describe(),
        "workload": problem.workload.describe(),
        "search": {"method": "exhaustive" if use_exhaustive else "mcmc", "seed": options.seed,
                   "proposals": result.steps, "seconds": round(result.seconds, 2)},
    }
    file_plan = to_execution_plan(problem, result.plan, result.estimate, notes)
    file_plan.validate(problem.graph, problem.models, problem.cluster.num_devices)
    plan_file = out_dir / "plan.yaml"
    file_plan.save(plan_file)
    picture = draw_timeline(result.estimate.sim.events, problem.cluster.num_devices, out_dir / "plan.png",
                            title=f"{problem.graph.name}: {result.estimate.iteration_s:.2f} s per iteration (estimated)")
    for line in format_table(problem, result, baselines):
        logger.info(line)
    logger.info(f"wrote {plan_file} and {picture}")
    return PlanOutcome(problem, result, baselines, plan_file, picture)


def format_table(problem: Problem, result: SearchResult, baselines: dict) -> list[str]:
    est = result.estimate
    rows = [("call", "kind", "devices", "layout", "micro-batches", "realloc s", "data s", "call s")]
    for call, choice in zip(problem.calls, result.plan):
        layout = choice.layout
        devices = format_ranks(tuple(sorted(layout.ranks)))
        rows.append((call.name, call.kind.value, devices, layout.shape, str(choice.micro_batches or "-"),
                     f"{est.realloc_s.get(call.name, 0.0):.3f}", f"{est.data_s.get(call.name, 0.0):.3f}",
                     f"{est.call_s[call.name]:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"estimated iteration: {est.iteration_s:.2f} s")
    for name, found in baselines.items():
        if found is None:
            lines.append(f"{name} baseline: no plan of its form fits in memory")
        else:
            speedup = found[1].iteration_s / est.iteration_s if math.isfinite(est.iteration_s) else float("nan")
            shapes = sorted({c.layout.shape for c in found[0]})
            lines.append(f"{name} baseline: {found[1].iteration_s:.2f} s ({', '.join(shapes)}); "
                         f"searched plan is {speedup:.2f}x faster")
    lines.append(f"search: {result.steps} plans proposed, {result.evaluated} estimated, {result.accepted} accepted "
                 f"({result.accepted_worse} worse), {result.seconds:.1f} s")
    return lines
