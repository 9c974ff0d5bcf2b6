"""The README's main command, timed: ``shardflow train`` on its embedded default (GRPO on the
arithmetic example, 4 CPU ranks).

Each run starts ``python -m shardflow train`` in a new output directory (its starting checkpoint
made again, as for any new directory) and records the seconds from the command's start to the end
of iteration 1 (the "iter 1" line), the median of the later iterations (``time/iteration`` in its
metrics) and the whole command. Every process of a run pays its imports: the figure moves with
what a rank loads, not only with the iteration's work. With ``bench/paired.py`` the same runs on
other commits' trees (the command runs from the working directory's package).

    python bench/example_run.py --out DIR [--runs 5] [--iterations 5] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(iterations: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "shardflow", "train", f"run.out_dir={out}", f"run.iterations={iterations}",
                   "run.progress=false", "run.tensorboard=false", "run.checkpoints=false",
                   "run.backend=gloo", *overrides]  # the CPU ranks of the README's command, GPU or not
        start = time.perf_counter()
        first = None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if first is None and line.startswith("iter 1 "):
                    first = time.perf_counter() - start
        total = time.perf_counter() - start
        if proc.returncode != 0 or first is None:
            raise RuntimeError(f"shardflow train failed (exit {proc.returncode}):\n{''.join(lines[-40:])}")
        metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    later = [m["time/iteration"] for m in metrics[1:]]
    return {"to_end_of_iteration_1_s": first, "iteration_1_s": metrics[0]["time/iteration"],
            "later_iteration_median_s": statistics.median(later) if later else None, "command_s": total,
            "rewards": [m["reward/mean"] for m in metrics]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the runs (repeatable)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [one_run(args.iterations, args.set) for _ in range(args.runs)]
    median = lambda key: statistics.median(r[key] for r in runs if r[key] is not None)  # noqa: E731
    summary = {key: median(key) for key in ("to_end_of_iteration_1_s", "iteration_1_s", "command_s")}
    if args.iterations > 1:
        summary["later_iteration_median_s"] = median("later_iteration_median_s")
    (out / "example_run.json").write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "runs": runs,
                                                      "median": summary}, indent=2))
    print(f"shardflow train (the embedded default), {args.runs} runs of {args.iterations} iterations, "
          f"{os.cpu_count()} CPUs: seconds")
    print(f"{'run':>4} {'to end of iter 1':>17} {'iter 1':>7} {'later (median)':>15} {'command':>8}")
    for i, r in enumerate(runs):
        later = f"{r['later_iteration_median_s']:.3f}" if r["later_iteration_median_s"] is not None else "-"
        print(f"{i:>4} {r['to_end_of_iteration_1_s']:>17.1f} {r['iteration_1_s']:>7.2f} {later:>15} "
              f"{r['command_s']:>8.1f}")
    later = f"{summary['later_iteration_median_s']:.3f}" if "later_iteration_median_s" in summary else "-"
    print(f"{'med':>4} {summary['to_end_of_iteration_1_s']:>17.1f} {summary['iteration_1_s']:>7.2f} {later:>15} "
          f"{summary['command_s']:>8.1f}")


if __name__ == "__main__":
    main()
