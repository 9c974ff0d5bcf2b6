"""Run named suites of benchmarks, each script under a time limit, into one output directory.

    python bench/run.py SUITE [SUITE ...] --out OUT [--list]

Every step runs one script of ``bench/`` with its arguments and ``--out OUT/STEP``; its output
goes to ``OUT/log.txt``, and the files it names are copied flat into ``OUT`` as ``STEP-FILE``
(the JSON that BENCHMARKS.md quotes). Wheels in ``.whl/`` (``bash bench/fetch_trl_wheels.sh``)
are installed first, for the TRL comparison on a machine without a package index. A step that
fails or runs out of time is reported and the suite goes on. The suites are the table below:
adding a measurement is one script plus one step.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    script: str
    args: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()  # files of its --out directory to copy into OUT

    def command(self, out: Path) -> list[str]:
        return [sys.executable, str(ROOT / "bench" / self.script), *self.args, "--out", str(out / self.name)]


# Each suite fits one 10-minute window on one GPU.
SUITES: dict[str, tuple[Step, ...]] = {
    # the decode step against its memory roofline and transformers, parity of the fast path; the
    # same with the weights stored transposed under cuBLASLt; where a step's time goes
    "decode": (
        Step("generation", 300, "generation.py", ("--batches", "1,64", "--contexts", "1024", "--steps", "24",
                                                  "--skip-transformers"), ("generation.json",)),
        Step("generation_transposed_lt", 200, "generation.py",
             ("--batches", "1,64", "--contexts", "1024", "--steps", "24", "--skip-transformers", "--skip-parity",
              "--transposed-weights", "--blas-library", "cublaslt"), ("generation.json",)),
        Step("prompt_kv", 60, "prompt_kv_attention.py", (), ("prompt_kv_attention.json",)),
    ),
    "decode-profile": (
        Step("decode_profile", 180, "decode_profile.py", (), ("decode_profile.json",)),
        Step("generation_all", 420, "generation.py", ("--steps", "24", "--hf-steps", "16"), ("generation.json",)),
    ),
    # one GRPO iteration against TRL's GRPOTrainer (at its default micro-batch) in the same run
    "iteration": (
        Step("iteration", 480, "iteration.py", ("--iterations", "3", "--trl-steps", "4", "--skip-planner"),
             ("iteration.json",)),
    ),
    # the training step, the shared-prompt training call, the fused log-probabilities, steps on
    # lengths that change (rows of attention padded to multiples against exact lengths)
    "train": (
        Step("train_step", 120, "train_step.py", ("--steps", "5"), ("train_step.json",)),
        Step("shared_prompts", 240, "shared_prompts.py", (), ("shared_prompts.json",)),
        Step("token_stats", 60, "token_stats.py", (), ("token_stats.json",)),
        Step("attention_plans", 60, "attention_plans.py", (), ("attention_plans.json",)),
        Step("varied_lengths", 240, "varied_lengths.py", (), ("varied_lengths.json",)),
    ),
    # training attention: each kernel against its FLOPs, then the shared-prompt training call with
    # each packed kernel (samples as padded rows; the key gather and flash attention's variable-length
    # kernel) against padded rows, on the two iteration workloads' shapes
    "packed-attention": (
        Step("train_attention", 120, "train_attention.py", (), ("train_attention.json",)),
        Step("shared_prompts", 240, "shared_prompts.py", ("--profile",), ("shared_prompts.json",)),
        Step("shared_prompts_long", 200, "shared_prompts.py",
             ("--shape", "qwen3-0.6b", "--prompts", "16", "--samples", "16", "--prompt-tokens", "200",
              "--response-tokens", "1024", "--skip-parity"), ("shared_prompts.json",)),
    ),
    # memory scale: the paged KV cache against the contiguous one, the offloaded optimizer step
    # against the host link, then the GRPO iteration (actor + reference) of a Qwen3-8B shape on one
    # device with the optimizer state on the host
    "memory": (
        Step("paged_kv", 150, "paged_kv.py", (), ("paged_kv.json",)),
        Step("optimizer_offload", 90, "optimizer_offload.py", (), ("optimizer_offload.json",)),
        Step("iteration_8b", 460, "iteration.py",
             ("--shape", "qwen3-8b", "--workload", "small", "--with-ref", "--skip-trl", "--skip-planner",
              "--iterations", "3", "--set", "models.actor.offload_optimizer=true",
              "--set", "models.actor.gradient_checkpointing=true"), ("iteration.json",)),
    ),
    # the first iteration on an empty compile cache, then on the one it filled
    "first-iteration": (
        Step("cold_and_warm", 420, "iteration.py", ("--cold-and-warm", "--iterations", "2", "--skip-trl",
                                                    "--skip-planner"), ("iteration.json",)),
        Step("layer_tracing", 180, "layer_tracing.py", (), ("layer_tracing.json",)),
        Step("example_run", 400, "example_run.py", (), ("example_run.json",)),
    ),
    "realloc": (Step("realloc", 300, "realloc.py", (), ("realloc.json",)),),
    "adaptive": (
        Step("adaptive", 120, "adaptive_tp.py", (), ("adaptive_tp.json", "adaptive_trace_simulated.png",
                                                     "decode_steps.json")),
    ),
    # multi-turn episodes: KV continuation against re-prefill, environments and rewards beside
    # decoding; the reward pool against one worker and the rank (CPU)
    "multiturn": (
        Step("multiturn", 300, "multiturn.py", (), ("multiturn.json",)),
        Step("reward_pool", 120, "reward_pool.py", ("--responses", "1024", "--workers", "1,2,4,8"),
             ("reward_pool.json",)),
    ),
    "realmodel": (
        Step("real_model", 560, "real_model.py", (), ("real_model.json",)),
    ),
    "planner": (
        Step("planner", 600, "planner.py", (), ("planner.json",)),
        Step("planner_accuracy", 240, "planner_accuracy.py", (), ("planner_accuracy.json",)),
    ),
}


def install_wheels() -> dict[str, str]:
    """The environment of the steps: wheels of ``.whl/`` installed into a side directory."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if wheels:
        site = Path("/tmp/shardflow-bench-site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(site), *wheels], check=False)
        env["PYTHONPATH"] += os.pathsep + str(site)
    return env


def run_suite(name: str, out: Path, env: dict[str, str], log) -> list[tuple[str, str, float]]:
    results = []
    for step in SUITES[name]:
        command = step.command(out)
        log.write(f"== {name}/{step.name} (limit {step.limit_s}s): {' '.join(command)}\n")
        log.flush()
        start = time.perf_counter()
        try:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=step.limit_s)
            status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = "timed out"
        seconds = time.perf_counter() - start
        log.write(f"== {name}/{step.name}: {status} in {seconds:.0f}s\n")
        for file in step.keep:
            if (out / step.name / file).is_file():
                shutil.copy(out / step.name / file, out / f"{step.name}-{file}")
        results.append((f"{name}/{step.name}", status, seconds))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", help=f"suites to run: {', '.join(SUITES)}")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--list", action="store_true", help="list the suites and their steps")
    args = parser.parse_args()
    if args.list or not args.suites:
        for name, steps in SUITES.items():
            print(f"{name}: " + ", ".join(f"{s.name} ({s.script})" for s in steps))
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown or not args.out:
        parser.error(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}" if unknown else "--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = install_wheels()
    results = []
    with open(out / "log.txt", "a") as log:
        for name in args.suites:
            results += run_suite(name, out, env, log)
    width = max(len(r[0]) for r in results)
    print(f"{'step':<{width}}  status     seconds")
    for step, status, seconds in results:
        print(f"{step:<{width}}  {status:<9}  {seconds:7.0f}")
    return 0 if all(r[1] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
