"""Plan PPO (7B actor and reference, 7B critic and reward model) on large simulated clusters.

For each cluster size it builds the symmetric and heuristic baselines, runs the MCMC search for
the time limit, and reports every plan's estimated iteration time and the wall time of planning
(which must stay within 10 minutes). The batch grows with the cluster: 4 prompts per GPU.

    python bench/planner.py --out OUT [--gpus 128,1024] [--time-limit 300] [--seed 0]

Prints a table and writes OUT/planner.json, with each searched plan (YAML) and its timeline (PNG).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardflow.config.load import load_config  # noqa: E402
from shardflow.perf.hardware import Cluster  # noqa: E402
from shardflow.plan.baselines import heuristic, symmetric  # noqa: E402
from shardflow.plan.estimate import to_execution_plan  # noqa: E402
from shardflow.plan.problem import problem_from_config  # noqa: E402
from shardflow.plan.search import SearchOptions, mcmc  # noqa: E402
from shardflow.plan.space import Space  # noqa: E402
from shardflow.plan.timeline import draw_timeline  # noqa: E402

CONFIG = ROOT / "examples" / "ppo_7b.yaml"
PROMPTS_PER_GPU = 4


def plan_one(gpus: int, time_limit: float, seed: int, out: Path) -> dict:
    t0 = time.perf_counter()
    config = load_config(CONFIG, [f"algorithm.batch_size={PROMPTS_PER_GPU * gpus}"])
    problem = problem_from_config(config, Cluster.for_devices(gpus))
    space = Space(problem)
    base = {"symmetric": symmetric(problem), "heuristic": heuristic(problem)}
    setup = time.perf_counter() - t0
    result = mcmc(space, [b[0] for b in base.values() if b], SearchOptions(time_limit_s=time_limit, seed=seed))
    wall = time.perf_counter() - t0
    plan = to_execution_plan(problem, result.plan, result.estimate)
    plan.validate(problem.graph, problem.models, gpus)
    plan.save(out / f"plan_{gpus}.yaml")
    draw_timeline(result.estimate.sim.events, gpus, out / f"plan_{gpus}.png",
                  title=f"PPO 7B+7B on {gpus} GPUs: {result.estimate.iteration_s:.2f} s per iteration (estimated)")
    row = {
        "gpus": gpus, "batch_size": config.algorithm.batch_size,
        "symmetric_s": base["symmetric"][1].iteration_s if base["symmetric"] else None,
        "heuristic_s": base["heuristic"][1].iteration_s if base["heuristic"] else None,
        "searched_s": result.estimate.iteration_s,
        "plan": {c.name: str(ch) for c, ch in zip(problem.calls, result.plan)},
        "call_s": result.estimate.call_s, "realloc_s": result.estimate.realloc_s,
        "proposals": result.steps, "accepted": result.accepted, "accepted_worse": result.accepted_worse,
        "setup_s": setup, "search_s": result.seconds, "wall_s": wall,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for planner.json, plans and pictures")
    parser.add_argument("--gpus", default="128,1024", help="cluster sizes (whole nodes of 8 GPUs)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="search seconds per cluster size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    header = f"{'GPUs':>5} {'batch':>6} {'symmetric s':>12} {'heuristic s':>12} {'searched s':>11} " \
             f"{'vs sym':>7} {'vs heur':>8} {'proposals':>10} {'wall s':>7}"
    print(header, flush=True)
    for gpus in (int(g) for g in args.gpus.split(",")):
        r = plan_one(gpus, args.time_limit, args.seed, out)
        rows.append(r)
        sym, heur = r["symmetric_s"], r["heuristic_s"]
        print(f"{gpus:>5} {r['batch_size']:>6} {sym or float('nan'):>12.3f} {heur or float('nan'):>12.3f} "
              f"{r['searched_s']:>11.3f} {(sym or float('nan')) / r['searched_s']:>6.2f}x "
              f"{(heur or float('nan')) / r['searched_s']:>7.2f}x {r['proposals']:>10} {r['wall_s']:>7.0f}",
              flush=True)
        for call, choice in r["plan"].items():
            print(f"      {call:13s} {choice}", flush=True)
    (out / "planner.json").write_text(json.dumps({"config": "examples/ppo_7b.yaml", "rows": rows}, indent=1))
    print(f"wrote {out / 'planner.json'}")


if __name__ == "__main__":
    main()
