"""One GRPO iteration, shardflow against TRL's GRPOTrainer, on the same workload in the same run.

    python bench/iteration.py --out runs/bench-iteration          # GPU: Qwen3-1.7B shape, bf16
    python bench/iteration.py --out runs/bench-iteration --tiny   # any machine: a tiny shape
    python bench/iteration.py --out runs/bench-8b --shape qwen3-8b --workload small --with-ref --skip-trl \
        --skip-planner --set models.actor.offload_optimizer=true --set models.actor.gradient_checkpointing=true

Workload (GPU, default): random Qwen3-1.7B-shaped weights, 32 prompts x 8 samples x 512 forced
response tokens (EOS ignored), one optimizer step per iteration, no KL term (TRL's default
beta=0), a cheap rule reward that varies within groups; ``--shape`` and ``--workload`` pick
others (``long``: 16 prompts x 16 samples x 1024 tokens after 200-token prompts), ``--with-ref``
adds the reference model and a KL term, ``--cold-and-warm`` measures the first iteration on an
empty compile cache and then on the cache that run filled. Both systems run in their own process, one after the other.
TRL's per-device micro-batch is a knob of its own (TRL's default is 8, this script's 32):
``--trl-micro-batches`` runs TRL once per value, each against the same shardflow run.
Reported: seconds per iteration (median after the first, which includes warm-up), the speed-up
over each TRL run at the medians and, as a bound that TRL's step-to-step spread cannot flatter,
at TRL's fastest step against shardflow's slowest (both after the first), shardflow's time per
phase, and each phase's roofline from the measured HBM bandwidth and matrix rate:
  generation: sum over decode steps of max(bytes read / bandwidth, FLOPs / matrix rate), plus
              each prompt's prefill once (a group's samples share it);
  training:   6 x (layer matrix parameters x tokens + LM head x response tokens) / matrix rate
              (forward + backward; a group's prompt counted once; log-probabilities are needed at
              response tokens only).
Prints a table and writes ``iteration.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3 = dict(head_dim=128, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960,
             rope_theta=1000000.0)
SHAPES = {  # Qwen3's published shapes, random weights
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                 tie_word_embeddings=True),
}
# trl_micro_batch: TRL's per-device micro-batch unless --trl-micro-batches says otherwise
WORKLOADS = {
    "default": dict(prompts=32, samples_per_prompt=8, prompt_tokens=64, response_tokens=512, trl_micro_batch=32),
    # longer responses after longer prompts (the small-model case)
    "long": dict(prompts=16, samples_per_prompt=16, prompt_tokens=200, response_tokens=1024, trl_micro_batch=32),
    # a light workload for the largest shapes
    "small": dict(prompts=8, samples_per_prompt=4, prompt_tokens=64, response_tokens=256, trl_micro_batch=8),
    "tiny": dict(prompts=4, samples_per_prompt=4, prompt_tokens=8, response_tokens=8, trl_micro_batch=8),
}


def spread_reward(prompts, responses, answers) -> list[float]:
    """The same cheap reward as the TRL side: varies within groups, costs nothing."""
    return [float(sum(map(ord, r)) % 7) / 6.0 for r in responses]


# ----- the workload ---------------------------------------------------------------------------------


def prepare(work: Path, shape: dict, workload: dict) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardflow.models.tiny import char_tokenizer

    cuda = torch.cuda.is_available()
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(work / "model")
    del model
    tokenizer = char_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(work / "model")
    n = workload["prompt_tokens"]
    with (work / "prompts.jsonl").open("w") as f:
        for i in range(workload["prompts"]):
            text = "".join(chr(ord("a") + (i * 7 + j * 3) % 26) for j in range(n))  # one token per char
            f.write(json.dumps({"prompt": text, "answer": ""}) + "\n")
    (work / "workload.json").write_text(json.dumps(workload))


def shardflow_config(work: Path, workload: dict, iterations: int, out: Path, with_ref: bool) -> Path:
    cfg = {
        "algorithm": {"name": "grpo", "batch_size": workload["prompts"]},
        "models": {"actor": {"path": str(work / "model"), "optim": {"lr": 1e-6}}},
        "data": {"path": str(work / "prompts.jsonl"), "chat_template": False,
                 "max_prompt_tokens": workload["prompt_tokens"], "shuffle": False},
        "generation": {"max_new_tokens": workload["response_tokens"],
                       "samples_per_prompt": workload["samples_per_prompt"], "force_length": True},
        "reward": {"kind": "function", "function": f"{Path(__file__).resolve()}:spread_reward"},
        "run": {"iterations": iterations, "devices": 1, "out_dir": str(out), "resume": False,
                "progress": False, "tensorboard": False, "checkpoints": False},
    }
    if with_ref:  # a KL term to the reference, the same weights as the actor's start
        cfg["algorithm"]["kl"] = {"coef": 0.01}
        cfg["models"]["ref"] = {"path": str(work / "model")}
    path = work / "shardflow.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ----- rooflines ------------------------------------------------------------------------------------


def measure_rates(device: torch.device) -> tuple[float, float]:
    """(bytes/s of a device copy counting read + write, bf16 matrix FLOP/s), or CPU guesses."""
    if device.type != "cuda":
        return 20e9, 100e9
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def median(fn, repeat=10):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    bandwidth = 2 * n / median(lambda: dst.copy_(src))
    flops = 2 * 8192**3 / median(lambda: a @ b)
    del src, dst, a, b
    torch.cuda.empty_cache()
    return bandwidth, flops


def rooflines(shape: dict, workload: dict, bandwidth: float, flops: float) -> dict[str, float]:
    from transformers import Qwen3Config

    from shardflow.config.model import ModelConfig

    hf = Qwen3Config(**shape)
    hf.architectures = ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    layers = cfg.num_layers * cfg.layer_params()  # matrix parameters of the layers
    head = cfg.vocab_size * cfg.hidden_size  # the LM head's
    weight_bytes = 2 * cfg.num_params()
    prompts, batch = workload["prompts"], workload["prompts"] * workload["samples_per_prompt"]
    prompt, response = workload["prompt_tokens"], workload["response_tokens"]
    kv_token = cfg.kv_bytes_per_token(2)
    generation = 0.0
    for step in range(response):
        read = weight_bytes + batch * (prompt + step) * kv_token
        generation += max(read / bandwidth, 2 * (layers + head) * batch / flops)
    # What is needed, no more: a group's samples share their prompt's prefill, which needs the
    # head's logits at its last token only; training runs a group's prompt through the layers once
    # too, and needs the head at response tokens only.
    prefill = 2 * (layers * prompts * prompt + head * batch) / flops
    training = 6 * (layers * (prompts * prompt + batch * response) + head * batch * response) / flops
    # A tighter floor for this implementation, whose kernels run one after another: each decode
    # step's products (the larger of their weight read and matrix time) and then its attention
    # (the KV read); training's products and then its causal attention's FLOPs (forward 2 T^2 q_size
    # per layer, backward 2.5 times that).
    generation_sequential = prefill + sum(
        max(weight_bytes / bandwidth, 2 * (layers + head) * batch / flops)
        + batch * (prompt + step) * kv_token / bandwidth for step in range(response))
    attention = 3.5 * 2 * (prompt + response) ** 2 * cfg.q_size * cfg.num_layers * batch / flops
    return {"generation_s": generation + prefill, "training_s": training,
            "sequential_generation_s": generation_sequential, "sequential_training_s": training + attention,
            "bandwidth_gb_s": bandwidth / 1e9, "matrix_tflops": flops / 1e12}


# ----- runs -----------------------------------------------------------------------------------------


def run_shardflow(work: Path, workload: dict, iterations: int, overrides: list[str], with_ref: bool,
                  stacks: Path | None = None, logs: Path | None = None) -> dict:
    """``stacks``: where the run's stack samples go (``bench/stack_sampler.py``), if anywhere; ``logs``:
    where the run's logs are copied."""
    out = work / "shardflow-run"
    config = shardflow_config(work, workload, iterations, out, with_ref)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    sampler = [str(ROOT / "bench" / "stack_sampler.py"), "--out", str(stacks)] if stacks is not None else []
    start, started_at = time.perf_counter(), time.time()
    subprocess.run([sys.executable, *sampler, "-m", "shardflow.cli.main", "train", str(config), *overrides],
                   check=True, env=env)
    wall = time.perf_counter() - start
    if logs is not None and (out / "logs").is_dir():
        shutil.copytree(out / "logs", logs, dirs_exist_ok=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first_end = rows[0]["time"] - started_at  # from the command to iteration 1's metrics
    steady = rows[1:] if len(rows) > 1 else rows
    phases = {k.removeprefix("time/"): statistics.median(r[k] for r in steady) for k in steady[0]
              if k.startswith("time/") and not k.startswith(("time/realloc", "time/compile", "time/jit", "time/setup"))}
    # what the first iteration spent compiling (per call) and on setup before it
    first = {k.removeprefix("time/"): v for k, v in rows[0].items()
             if k.startswith(("time/compile", "time/jit", "time/setup"))}
    first_phases = {k.removeprefix("time/"): v for k, v in rows[0].items() if k.startswith("time/")
                    and not k.startswith(("time/compile", "time/jit", "time/setup"))}
    graphs = {k.removeprefix("compile/"): v for k, v in rows[0].items() if k.startswith("compile/")}  # cached, built
    recompiled = sorted({k for r in rows[1:] for k in r if k.startswith(("time/compile", "time/jit"))})
    peaks = {k.removeprefix("memory/").removesuffix("/peak_gb"): max(r[k] for r in rows) for k in rows[0]
             if k.startswith("memory/")}
    return {"iteration_s": [r["time/iteration"] for r in rows], "median_iteration_s": phases.pop("iteration"),
            "peak_memory_gb": peaks, "first_iteration_end_s": first_end, "first_iteration_s": first,
            "first_iteration_phases_s": first_phases, "first_iteration_graphs": graphs, "recompiled_later": recompiled,
            "phases_s": phases, "tokens_per_s": statistics.median(r.get("generation/tokens_per_s", 0) for r in steady),
            "micro_batches": {k.removesuffix("/num_micro_batches"): statistics.median(r[k] for r in steady)
                              for k in steady[0] if k.endswith("/num_micro_batches")},
            "process_wall_s": wall}


def run_trl(work: Path, steps: int, micro_batch: int) -> dict:
    out = work / "trl.json"
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "bench" / "trl_grpo.py"), "--workdir", str(work), "--steps",
                    str(steps), "--micro-batch", str(micro_batch), "--out", str(out)], check=True)
    result = json.loads(out.read_text())
    steady = result["step_seconds"][1:] or result["step_seconds"]
    return {**result, "median_step_s": statistics.median(steady), "process_wall_s": time.perf_counter() - start}


def speed_up(ours: dict, trl: dict) -> dict:
    """TRL's time over shardflow's: at the medians, and at TRL's fastest steady step against
    shardflow's slowest steady iteration (the first of each holds warm-up)."""
    mine = ours["iteration_s"][1:] or ours["iteration_s"]
    theirs = trl["step_seconds"][1:] or trl["step_seconds"]
    return {"median": trl["median_step_s"] / ours["median_iteration_s"], "worst_case": min(theirs) / max(mine)}


def planner_estimates(work: Path, ours: dict, workload: dict) -> dict:
    """The planner's estimate of each call of this very run (a profile measured now, on this
    device, then the cost model), against the run's measured median call times."""
    from shardflow.config.load import load_config
    from shardflow.perf.hardware import Cluster
    from shardflow.plan.estimate import estimate, from_execution_plan
    from shardflow.plan.execution_plan import ExecutionPlan
    from shardflow.plan.problem import problem_from_config
    from shardflow.profiler.measure import run_profile

    profile_path = work / "profile.json"
    cuda = torch.cuda.is_available()
    # The quick grid (a few tiny, launch-bound sizes) is a smoke test: extrapolated to this workload's
    # micro-batches it is off by orders of magnitude, so on a GPU the full grid is measured.
    profile = run_profile(str(work / "model"), str(profile_path), tps="1", quick=not cuda, ranks=1,
                          cuda_graphs=cuda)
    config = load_config(work / "shardflow.yaml")
    problem = problem_from_config(config, Cluster.for_devices(1), profile=profile,
                                  prompt_tokens=workload["prompt_tokens"],
                                  response_mean=float(workload["response_tokens"]), response_std=0.0)
    plan = ExecutionPlan.from_dict(yaml.safe_load((work / "shardflow-run" / "plan.yaml").read_text()))
    est = estimate(problem, from_execution_plan(problem, plan))
    rows = {}
    for call, measured in ours["phases_s"].items():
        if call in est.call_s:
            rows[call] = {"estimated_s": est.call_s[call], "measured_s": measured,
                          "relative_error": (est.call_s[call] - measured) / measured}
    return {"calls": rows, "estimated_iteration_s": est.iteration_s, "feasible": est.feasible,
            "reason": est.reason}


def _positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shape and workload (CPU check)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    parser.add_argument("--with-ref", action="store_true", help="a reference model and KL term (GRPO with beta > 0)")
    parser.add_argument("--cold-and-warm", action="store_true",
                        help="run shardflow twice on one new compile cache: first empty (cold), then warm; the warm "
                             "run is the one compared")
    parser.add_argument("--sample-stacks", action="store_true",
                        help="sample shardflow's stacks every 10 ms (bench/stack_sampler.py): stacks-cold.json and "
                             "stacks.json in --out")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--trl-steps", type=int, default=3)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-micro-batches", type=_positive_ints, metavar="N[,N...]",
                        help="TRL's per-device micro-batch, one TRL run per value (default: 32, the tiny shape 8; "
                             "TRL's own default is 8)")
    parser.add_argument("--skip-planner", action="store_true", help="no planner estimate (its profile takes minutes)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for shardflow's run, e.g. algorithm.micro_batch_tokens=32768 "
                             "(repeatable)")
    args = parser.parse_args()
    shape, workload = (SHAPES["tiny"], WORKLOADS["tiny"]) if args.tiny else (SHAPES[args.shape],
                                                                            WORKLOADS[args.workload])
    batch = workload["prompts"] * workload["samples_per_prompt"]
    trl_micro_batches = args.trl_micro_batches or [workload["trl_micro_batch"]]
    if any(batch % n for n in trl_micro_batches):
        parser.error(f"--trl-micro-batches {trl_micro_batches}: each must divide the batch of {batch} samples")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work, shape, workload)
        bandwidth, flops = measure_rates(device)
        roof = rooflines(shape, workload, bandwidth, flops)
        result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "shape": shape, "workload": workload, "roofline": roof,
                  "overrides": args.set, "with_ref": args.with_ref}
        overrides = list(args.set)
        if args.cold_and_warm:  # both runs on one new cache directory; the first finds it empty
            overrides.append(f"run.compile_cache={work / 'compile-cache'}")
            result["cold"] = run_shardflow(work, workload, args.iterations, overrides, args.with_ref,
                                           out / "stacks-cold.json" if args.sample_stacks else None, out / "logs-cold")
        result["shardflow"] = ours = run_shardflow(work, workload, args.iterations, overrides, args.with_ref,
                                                   out / "stacks.json" if args.sample_stacks else None, out / "logs")
        (out / "iteration.json").write_text(json.dumps(result, indent=2))  # kept if the peer fails
        # The peer first: the planner's profile (minutes on a GPU) must not cost the comparison.
        result["trl"] = {}  # per-device micro-batch -> TRL's run, with the speed-up over it
        for micro_batch in [] if args.skip_trl else trl_micro_batches:
            try:
                trl = run_trl(work, args.trl_steps, micro_batch)
            except (subprocess.CalledProcessError, OSError) as e:
                result.setdefault("trl_error", {})[micro_batch] = str(e)
                continue
            result["trl"][micro_batch] = {**trl, "speed_up": speed_up(ours, trl)}
            (out / "iteration.json").write_text(json.dumps(result, indent=2))
        planner = {}
        if not args.skip_planner:
            try:
                planner = planner_estimates(work, ours, workload)
            except Exception as e:  # noqa: BLE001 - keep the measurements if the estimate fails
                planner = {"error": f"{type(e).__name__}: {e}"}
        result["planner"] = planner
    (out / "iteration.json").write_text(json.dumps(result, indent=2))

    print(f"\nGRPO iteration, {result['device']}: {workload['prompts']} prompts x {workload['samples_per_prompt']} "
          f"samples x {workload['response_tokens']} tokens")
    print("| system | s/iteration | generation s | training s | roofline s |")
    print("|---|---:|---:|---:|---:|")
    total_roof = roof["generation_s"] + roof["training_s"]
    ph = ours["phases_s"]
    print(f"| shardflow | {ours['median_iteration_s']:.2f} | {ph.get('actor_gen', 0):.2f} | "
          f"{ph.get('actor_train', 0):.2f} | {total_roof:.2f} |")
    for micro_batch, trl in result["trl"].items():
        print(f"| TRL GRPOTrainer, micro-batch {micro_batch} | {trl['median_step_s']:.2f} |  |  | {total_roof:.2f} |")
    if "cold" in result:
        cold = result["cold"]
        print(f"cold compile cache: iteration 1 ends {cold['first_iteration_end_s']:.1f} s after the command "
              f"(iteration 1 {cold['iteration_s'][0]:.1f} s, then {cold['median_iteration_s']:.2f} s); the run below "
              "found the cache warm")
    for name, run in (("cold", result.get("cold")), ("warm" if "cold" in result else "shardflow", ours)):
        if run is not None:
            print(f"{name}: before iteration 1 and compiling in it (s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in run["first_iteration_s"].items())
                  + (f"; graphs {', '.join(f'{k} {v:.0f}' for k, v in run['first_iteration_graphs'].items())}"
                     if run["first_iteration_graphs"] else "")
                  + (f"; compiled again later: {', '.join(run['recompiled_later'])}" if run["recompiled_later"] else ""))
    print("shardflow: iteration 1 by phase (s): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                          ours["first_iteration_phases_s"].items()))
    print(f"shardflow: iteration 1 ends {ours['first_iteration_end_s']:.1f} s after the command "
          f"(iteration 1 {ours['iteration_s'][0]:.1f} s); peak device memory per call (GB): "
          + (", ".join(f"{k} {v:.1f}" for k, v in ours["peak_memory_gb"].items()) or "not measured (no GPU)")
          + "; training's micro-batches per step: "
          + (", ".join(f"{k} {v:.0f}" for k, v in ours["micro_batches"].items()) or "not reported"))
    for micro_batch, trl in result["trl"].items():
        up = trl["speed_up"]
        print(f"speed-up over TRL at micro-batch {micro_batch}: {up['median']:.2f}x at the medians, "
              f"{up['worst_case']:.2f}x at TRL's fastest step against shardflow's slowest iteration")
    for call, row in planner.get("calls", {}).items():
        print(f"planner estimate {call}: {row['estimated_s']:.2f} s vs measured {row['measured_s']:.2f} s "
              f"({100 * row['relative_error']:+.0f}%)")
    if "error" in planner:
        print(f"planner estimate failed: {planner['error']}")
    for micro_batch, error in result.get("trl_error", {}).items():
        print(f"TRL at micro-batch {micro_batch} failed: {error}")
    print(f"rooflines: generation {roof['generation_s']:.2f} s, training {roof['training_s']:.2f} s "
          f"(HBM {roof['bandwidth_gb_s']:.0f} GB/s, bf16 {roof['matrix_tflops']:.0f} TFLOP/s measured); "
          f"with the kernels in sequence: generation {roof['sequential_generation_s']:.2f} s, "
          f"training {roof['sequential_training_s']:.2f} s")


if __name__ == "__main__":
    main()
