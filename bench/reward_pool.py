"""Rewards scored by a pool of worker processes against one worker and against the rank itself.

    python bench/reward_pool.py --out runs/bench-rewards [--responses 512] [--workers 1,2,4]

Two rewards: the ``math`` reward (math-verify) on ``--responses`` responses of the form "the
answer is \\boxed{N}", half right; and a reward that computes for ``--busy-ms`` per response
(``bench_envs:busy_reward``). Each is scored serially in this process (what the reward call does
without a pool), then through ``PooledRewards`` with each worker count: one task per response,
all submitted, then collected. The workers are started and warmed (imports) before the clock.
Prints a table and writes ``reward_pool.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardflow.config.experiment import RewardConfig  # noqa: E402
from shardflow.rl.rewards import reward_function  # noqa: E402
from shardflow.rl.rewards.pooled import PooledRewards  # noqa: E402
from shardflow.rl.workers import WorkerPool  # noqa: E402


def texts(n: int, busy_ms: float) -> dict[str, tuple[list, list, list]]:
    prompts = [f"What is {i} + {i}?" for i in range(n)]
    math = [f"Adding them gives \\boxed{{{2 * i + (i % 2)}}}." for i in range(n)]
    return {"math": (prompts, math, [str(2 * i) for i in range(n)]),
            "busy": (prompts, ["x"] * n, [busy_ms] * n)}


CONFIGS = {"math": RewardConfig(kind="math"),
           "busy": RewardConfig(kind="function", function="bench_envs:busy_reward")}


def pooled(pool: WorkerPool, config: RewardConfig, data) -> tuple[float, list[float]]:
    scorer = PooledRewards(pool, config)
    start = time.perf_counter()
    for i, (p, r, a) in enumerate(zip(*data)):
        scorer.submit(i, p, r, a)
    scores = scorer.collect()
    return time.perf_counter() - start, [scores.rewards[i] for i in range(len(data[0]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--busy-ms", type=float, default=5.0)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = texts(args.responses, args.busy_ms)
    report = {"cpus": os.cpu_count(), "responses": args.responses, "busy_ms": args.busy_ms, "rewards": {}}
    for name, config in CONFIGS.items():
        fn = reward_function(config)
        fn(*(x[:2] for x in data[name]))  # imports
        start = time.perf_counter()
        serial = [v for i in range(args.responses) for v in fn(*([x[i]] for x in data[name]))]
        row = {"in_rank_s": time.perf_counter() - start}
        for workers in (int(w) for w in args.workers.split(",")):
            with WorkerPool(workers) as pool:
                pooled(pool, config, tuple(x[: 4 * workers] for x in data[name]))  # start and warm every worker
                seconds, values = pooled(pool, config, data[name])
            if values != serial:
                sys.exit(f"{name}: the pool of {workers} scored differently from the rank")
            row[f"workers_{workers}_s"] = seconds
        report["rewards"][name] = row
    (out / "reward_pool.json").write_text(json.dumps(report, indent=1))
    counts = [int(w) for w in args.workers.split(",")]
    print(f"{args.responses} responses, {report['cpus']} CPUs: seconds to score all")
    print(f"{'reward':8}{'in rank':>9}" + "".join(f"{f'{w} worker(s)':>13}" for w in counts))
    for name, row in report["rewards"].items():
        print(f"{name:8}{row['in_rank_s']:9.2f}" + "".join(f"{row[f'workers_{w}_s']:13.2f}" for w in counts))


if __name__ == "__main__":
    main()
