"""GRPO on a real pretrained model, shardflow against TRL: the real-model example (SmolLM2-135M-
Instruct, word problems, the math reward) run by both with the same settings, held-out greedy
accuracy every few iterations for both (they should learn alike) and the wall time of both.

    python bench/real_model.py --out runs/bench-real [--gguf FILE] [--iterations 40] [--skip-trl]

The model is converted from the example's GGUF file (the model package's, or ``--gguf``) into
``--out``. shardflow runs ``shardflow train`` on the example's config with ``--devices`` ranks (every
call on all of them); TRL runs ``bench/trl_real_model.py`` in its own process. Prints a table and
writes ``real_model.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardflow.examples import smollm2  # noqa: E402
from shardflow.models.gguf import convert_gguf  # noqa: E402


def shardflow_run(model: Path, out: Path, args: argparse.Namespace) -> dict:
    raw = yaml.safe_load(smollm2.CONFIG_FILE.read_text())
    raw["models"]["actor"]["path"] = str(model)
    raw["models"]["actor"]["optim"]["lr"] = args.lr
    raw["data"]["path"], raw["eval"]["path"] = str(smollm2.TRAIN_FILE), str(smollm2.EVAL_FILE)
    raw["eval"].update(every=args.eval_every, max_prompts=args.eval_prompts, samples=0)
    raw["run"].update(iterations=args.iterations, devices=args.devices, out_dir=str(out / "shardflow"),
                      checkpoints=False, tensorboard=False, progress=False, resume=False)
    config = out / "shardflow.yaml"
    config.write_text(yaml.safe_dump(raw))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardflow", "train", str(config)], check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "shardflow" / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/iteration"] for r in records if "time/iteration" in r]
    return {"wall_seconds": wall, "step_seconds": times, "rewards": [r["reward/mean"] for r in records
                                                                     if "reward/mean" in r],
            "eval": {r["step"]: r["eval/pass@1"] for r in records if "eval/pass@1" in r},
            "eval_seconds": sum(r.get("eval/seconds", 0.0) for r in records),
            "eval_seconds_each": {r["step"]: r["eval/seconds"] for r in records if "eval/seconds" in r}}


def trl_run(model: Path, out: Path, args: argparse.Namespace, raw: dict) -> dict:
    result = out / "trl.json"
    command = [sys.executable, str(ROOT / "bench" / "trl_real_model.py"), "--model", str(model),
               "--steps", str(args.iterations), "--eval-every", str(args.eval_every),
               "--eval-prompts", str(args.eval_prompts), "--lr", str(args.lr),
               "--prompts", str(raw["algorithm"]["batch_size"]),
               "--samples", str(raw["generation"]["samples_per_prompt"]),
               "--max-new-tokens", str(raw["generation"]["max_new_tokens"]), "--out", str(result)]
    subprocess.run(command, check=True, cwd=ROOT)
    record = json.loads(result.read_text())
    record["eval"] = {int(k): v for k, v in record["eval"].items()}
    return record


def summary(run: dict) -> dict:
    steps = run["step_seconds"]
    return {"first_iteration_s": steps[0] if steps else None,
            "median_iteration_s": sorted(steps)[len(steps) // 2] if steps else None,
            "train_seconds": sum(steps), "wall_seconds": run["wall_seconds"], "eval_seconds": run["eval_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the model package's)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--lr", type=float, default=None, help="default: the example's")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load(smollm2.CONFIG_FILE.read_text())
    args.lr = args.lr or raw["models"]["actor"]["optim"]["lr"]
    start = time.perf_counter()
    model = convert_gguf(args.gguf or smollm2.gguf_file(), out / "model")
    result = {"convert_seconds": time.perf_counter() - start, "iterations": args.iterations, "lr": args.lr,
              "eval_prompts": args.eval_prompts, "prompts": raw["algorithm"]["batch_size"],
              "samples": raw["generation"]["samples_per_prompt"],
              "max_new_tokens": raw["generation"]["max_new_tokens"]}
    runs = {"shardflow": shardflow_run(model, out, args)}
    (out / "real_model.json").write_text(json.dumps({**result, "runs": runs}, indent=2))  # kept if the peer fails
    if not args.skip_trl:
        runs["trl"] = trl_run(model, out, args, raw)
    result["runs"] = runs
    result["summary"] = {name: summary(run) for name, run in runs.items()}
    (out / "real_model.json").write_text(json.dumps(result, indent=2))

    names = list(runs)
    print("held-out greedy pass@1 (" + str(args.eval_prompts) + " prompts) per iteration")
    print(f"{'iteration':>9}  " + "  ".join(f"{n:>9}" for n in names))
    for step in sorted(runs["shardflow"]["eval"]):
        print(f"{step:>9}  " + "  ".join(f"{runs[n]['eval'].get(step, float('nan')):>9.3f}" for n in names))
    print(f"{'':>9}  " + "  ".join(f"{n:>9}" for n in names))
    for key in ("first_iteration_s", "median_iteration_s", "train_seconds", "eval_seconds", "wall_seconds"):
        print(f"{key:>18}  " + "  ".join(f"{result['summary'][n][key]:>9.2f}" for n in names))


if __name__ == "__main__":
    main()
