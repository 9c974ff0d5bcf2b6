"""Shared prompts (a prompt's samples in one packed row holding the prompt once) against padded
rows: parity on this device, then the training call's time on the GRPO iteration's shape.

    python bench/shared_prompts.py --out runs/bench-shared          # GPU: parity, then Qwen3-1.7B shape
    python bench/shared_prompts.py --out runs/bench-shared --shape qwen3-0.6b --prompts 16 --samples 16 \
        --prompt-tokens 200 --response-tokens 1024 --skip-parity   # the small model's long responses
    python bench/shared_prompts.py --out runs/bench-shared --tiny   # any machine: a tiny shape

1. parity: a small random Qwen3 (q/k norms, GQA) computes log-probabilities of prompts with several
   samples of different lengths, and takes one training step, with padded rows and with shared
   prompts, in the run's dtype (bf16 on GPU, compiled layers, where shared rows run each packed
   attention kernel: samples as padded rows, and the key gather with flash attention's
   variable-length kernel)
   and in float32 with padded rows as the reference. The shared rows' error against the reference
   must stay within 1.5x of the padded rows' own (plus a floor of bf16 noise), for the
   log-probabilities and for the gradient, and the shared rows must hold fewer tokens; the script
   exits non-zero otherwise.
2. attention: forward and backward of one layer's attention over one micro-batch of the workload,
   padded rows (``scaled_dot_product_attention``, causal) against shared rows under each kernel
   (and the key gather alone), each against its FLOPs at the matrix rate; on GPU the kernels'
   outputs and gradients against float32, which must agree within bf16 rounding.
3. speed: one training step of the GRPO iteration's call (``--prompts`` x ``--samples`` sequences of
   ``--prompt-tokens`` + ``--response-tokens``), padded and shared (each kernel), median of
   ``--steps`` after a warm-up, with the tokens each runs through the layers; with ``--profile``
   (GPU), the device time of one shared step by kind of kernel, its top kernels, and where the
   device waited on the host. Each row also gives the host's work on its micro-batches: before the
   first (the plan and the first micro-batch: the device idles) and in all.
With ``--host-only`` (any machine, no model): that host work alone, into ``host_work.json``.
Prints a table and writes ``shared_prompts.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import SHAPES, measure_rates  # noqa: E402

from train_step import kernel_profile, print_idle  # noqa: E402

from shardflow.config.experiment import OptimConfig  # noqa: E402
from shardflow.data.batch import SequenceBatch  # noqa: E402
from shardflow.engine.inference import infer  # noqa: E402
from shardflow.engine.shared_prompts import (  # noqa: E402
    group_by_prompt,
    make_shared_micro_batches,
    plan_micro_batches,
    split_rows,
)
from shardflow.engine.train.engine import TrainEngine  # noqa: E402
from shardflow.models import transformer  # noqa: E402
from shardflow.models.checkpoint import load_model  # noqa: E402
from shardflow.models.packed_attention import fa4_available, gather_keys, packed_attention  # noqa: E402
from shardflow.models.tiny import make_tiny_checkpoint  # noqa: E402
from shardflow.models.transformer import causal_attention  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.world import World  # noqa: E402

PARITY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, vocab_size=512, tie_word_embeddings=True)
TINY_SHAPE = {**SHAPES["qwen3-1.7b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}


class PolicyLoss:
    """Token-mean advantage-weighted log-likelihood: a GRPO-like loss with one step per batch."""

    entropy_grad = False

    def normalizer(self, batch: SequenceBatch) -> float:
        return float(batch.token_fields["loss_mask"].sum())

    def __call__(self, outputs, mb, normalizer):
        loss = -(mb.token_fields["advantages"] * outputs["logprobs"] * mb.token_fields["loss_mask"]).sum()
        return loss / normalizer, {}


def group_batch(vocab: int, prompts: int, samples: int, prompt_tokens: tuple[int, int],
                response_tokens: tuple[int, int], seed: int = 0) -> SequenceBatch:
    """Prompts of lengths in ``prompt_tokens`` (inclusive range), ``samples`` responses each of lengths
    in ``response_tokens``, shuffled, with a loss mask on the responses and random advantages."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        p = int(torch.randint(prompt_tokens[0], prompt_tokens[1] + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for _ in range(samples):
            r = int(torch.randint(response_tokens[0], response_tokens[1] + 1, (1,), generator=g))
            seqs.append((torch.cat([prompt, torch.randint(3, vocab, (r,), generator=g)]), p))
    seqs = [seqs[i] for i in torch.randperm(len(seqs), generator=g).tolist()]
    return SequenceBatch.from_lists(range(len(seqs)), {
        "input_ids": [ids for ids, _ in seqs],
        "loss_mask": [(torch.arange(len(ids)) >= p).float() for ids, p in seqs],
        "advantages": [torch.full((len(ids),), float(torch.randn(1, generator=g))) for ids, _ in seqs],
    })


def one_rank(device: torch.device) -> tuple[World, Layout]:
    return World(rank=0, size=1, device=device, backend="gloo"), Layout((0,))


def parity(work: Path, device: torch.device, dtype: torch.dtype) -> dict:
    path = make_tiny_checkpoint(work / "parity", "qwen3", **PARITY_SHAPE)
    world, layout = one_rank(device)
    batch = group_batch(PARITY_SHAPE["vocab_size"], prompts=6, samples=4, prompt_tokens=(3, 40),
                        response_tokens=(1, 100))
    wanted = batch.token_fields["loss_mask"] > 0

    def run(run_dtype: torch.dtype, share: bool, kernel: str = "auto"):
        model, _ = load_model(path, layout, world, dtype=run_dtype)
        if device.type == "cuda":  # as the runtime runs it
            model.compile_layers()
        logprobs = infer(model, layout, world, batch, "logprobs", micro_batch_tokens=1024, outputs_at="loss_mask",
                         share_prompts=share, attention=kernel).token_fields["logprobs"].float().cpu()
        engine = TrainEngine(model, layout, world, OptimConfig(lr=1e-3, grad_clip=0.0))
        metrics = engine.step(batch, PolicyLoss(), micro_batch_tokens=1024, share_prompts=share, attention=kernel)
        return logprobs[wanted], engine.grads.flat.float().cpu().clone(), metrics["model_tokens"]

    ref_lp, ref_grad, _ = run(torch.float32, False)
    out = {}
    for name, share, kernel in (("padded", False, "auto"), *((f"shared_{k}", True, k) for k in kernels(device))):
        lp, grad, tokens = run(dtype, share, kernel)
        out[name] = {"logprob_max_abs_err": (lp - ref_lp).abs().max().item(),
                     "grad_rel_err": ((grad - ref_grad).norm() / ref_grad.norm()).item(), "model_tokens": tokens}
    floor = 1e-4 if dtype == torch.float32 else 2e-2  # summation-order noise of each dtype
    errors = ("logprob_max_abs_err", "grad_rel_err")
    shared = [name for name in out if name.startswith("shared")]
    out["ok"] = all(all(out[name][k] <= 1.5 * out["padded"][k] + floor for k in errors)
                    and out[name]["model_tokens"] < out["padded"]["model_tokens"] for name in shared)  # rows shared
    return out


def kernels(device: torch.device) -> tuple[str, ...]:
    """The packed attention kernels to compare: on CPU every kernel is the same masked attention;
    FlashAttention-4's where its package is installed."""
    if device.type != "cuda":
        return ("auto",)
    return ("varlen", "rows", *(("fa4",) if fa4_available() else ()))


def attention(device: torch.device, dtype: torch.dtype, shape: dict, args) -> dict:
    """ms per forward + backward of one layer's attention over the first micro-batch, against its
    FLOPs at the matrix rate; on GPU, each packed kernel's error against float32."""
    n = (args.prompt_tokens, args.prompt_tokens)
    r = (args.response_tokens, args.response_tokens)
    batch = group_batch(shape["vocab_size"], args.prompts, args.samples, n, r, seed=1)
    runs = split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(), args.micro_batch_tokens)
    mbs = {k: make_shared_micro_batches(batch, runs[:1], device, outputs_at="loss_mask", attention=k)[0]
           for k in kernels(device)}
    mb = next(iter(mbs.values()))
    rows, length = len(mb.batch), int(mb.batch.lengths.max())
    h, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    tokens = mb.ids.shape[1]
    g = torch.Generator(device=device).manual_seed(0)

    def make(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=g).requires_grad_()

    padded = [make(rows, heads, length, d) for heads in (h, kv, kv)]
    shared = [make(tokens, heads, d) for heads in (h, kv, kv)]

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.attention_repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / args.attention_repeats

    def backward_of(out: torch.Tensor) -> None:
        out.backward(torch.ones_like(out))

    slots = len(mb.packed.kv_index)
    key_grads = [torch.ones(slots, kv, d, device=device, dtype=dtype) for _ in range(2)]

    def gather() -> None:
        torch.autograd.backward([gather_keys(t, mb.packed) for t in shared[1:]], key_grads)

    # visible (query, key) pairs: forward 4 FLOPs per pair and head dimension per head, backward 2.5x
    cu_q, cu_k = mb.packed.cu_q.tolist(), mb.packed.cu_k.tolist()
    pairs = sum(sum(lk - lq + j + 1 for j in range(lq))
                for lq, lk in ((cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]) for s in range(len(cu_q) - 1)))
    flops = 3.5 * 4 * pairs * h * d
    rate = measure_rates(device)[1]
    out = {"padded_rows": rows, "padded_length": length, "shared_tokens": tokens, "pairs": pairs,
           "flops_ms": 1e3 * flops / rate, "matrix_tflops": rate / 1e12,
           "padded_ms": timed(lambda: backward_of(causal_attention(*padded, None))),
           "gather_ms": timed(gather)}
    for kernel, m in mbs.items():
        out[f"shared_{kernel}_ms"] = timed(lambda: backward_of(packed_attention(*shared, m.packed)))
    if device.type == "cuda":  # each kernel against float32 (the padded sequences' masked attention)
        weights = torch.randn(tokens, h, d, device=device, generator=g)
        ref = [t.detach().float().requires_grad_() for t in shared]
        (packed_attention(*ref, mb.packed) * weights).sum().backward()
        for kernel, m in mbs.items():
            leaves = [t.detach().requires_grad_() for t in shared]
            got = packed_attention(*leaves, m.packed)
            (got.float() * weights).sum().backward()
            rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
            out[f"shared_{kernel}_err"] = {"out": rel(got, packed_attention(*ref, mb.packed).detach()),
                                           "grads": [rel(a.grad, b.grad) for a, b in zip(leaves, ref)]}
        out["ok"] = all(e <= 2e-2 for k in mbs for e in (out[f"shared_{k}_err"]["out"], *out[f"shared_{k}_err"]["grads"]))
    return out


def speed(work: Path, device: torch.device, dtype: torch.dtype, shape: dict, args) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, rms_norm_eps=1e-6)
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.device(device):
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(work / "model")
    world, layout = one_rank(device)
    n = (args.prompt_tokens, args.prompt_tokens)
    r = (args.response_tokens, args.response_tokens)
    batch = group_batch(shape["vocab_size"], args.prompts, args.samples, n, r, seed=1)
    model, _ = load_model(work / "model", layout, world, dtype=dtype)
    if device.type == "cuda":
        model.compile_layers()
    engine = TrainEngine(model, layout, world, OptimConfig(lr=1e-7))
    out = {}
    cases = (("padded", False, "auto"), *((f"shared_{k}", True, k) for k in kernels(device)))
    for name, share, kernel in (c for c in cases if args.cases is None or c[0] in args.cases):
        times, metrics = [], {}
        for _ in range(args.steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = engine.step(batch, PolicyLoss(), micro_batch_tokens=args.micro_batch_tokens, share_prompts=share,
                                  attention=kernel)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[name] = {"step_s": statistics.median(times[1:]), "steps_s": times,
                     "model_tokens": metrics["model_tokens"], "micro_batches": metrics["num_micro_batches"],
                     **host_work(batch, device, args.micro_batch_tokens, share, kernel)}
    for budget in args.sweep_budgets or ():
        out[f"budget_{budget}"] = budget_step(engine, batch, budget, device, args.steps)
    for kernel in ("rows", "fa4"):
        if args.profile and device.type == "cuda" and f"shared_{kernel}" in out:
            out[f"shared_{kernel}"]["profile"] = kernel_profile(
                lambda: engine.step(batch, PolicyLoss(), micro_batch_tokens=args.micro_batch_tokens,
                                    share_prompts=True, attention=kernel))
    return out


def budget_step(engine: TrainEngine, batch: SequenceBatch, budget: int, device: torch.device, steps: int) -> dict:
    """One shared-rows step (the rows kernel) at a micro-batch token budget: median of ``steps`` after a
    warm-up, with the device's peak memory (GPU); a budget the device's memory cannot hold is recorded
    as such and the sweep goes on."""
    times, metrics = [], {}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(steps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = engine.step(batch, PolicyLoss(), micro_batch_tokens=budget, share_prompts=True, attention="rows")
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as e:
        return {"budget": budget, "out_of_memory": str(e).splitlines()[0]}
    row = {"budget": budget, "step_s": statistics.median(times[1:]), "steps_s": times,
           "micro_batches": metrics["num_micro_batches"]}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def host_work(batch: SequenceBatch, device: torch.device, budget: int, share: bool, kernel: str) -> dict:
    """The step's host work on its micro-batches, median of 3: the plan and the first micro-batch
    (before the device has anything to run) and all of them (each built while the device runs the
    one before; ``engine.micro_batches.MicroBatches``)."""
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        _, micro = plan_micro_batches(batch, budget, device, outputs_at="loss_mask", share_prompts=share,
                                      attention=kernel)
        micro[0]
        first = time.perf_counter()
        for _ in micro:
            pass
        runs.append((first - start, time.perf_counter() - start))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return {"host_before_first_ms": 1e3 * statistics.median(r[0] for r in runs),
            "host_all_ms": 1e3 * statistics.median(r[1] for r in runs)}


def host_only(device: torch.device, out: Path, args) -> None:
    """``host_work`` of each case on the workload's batch, printed and written to host_work.json."""
    shape = TINY_SHAPE if args.tiny else SHAPES[args.shape]
    batch = group_batch(shape["vocab_size"], args.prompts, args.samples, (args.prompt_tokens,) * 2,
                        (args.response_tokens,) * 2, seed=1)
    cases = (("padded", False, "auto"), *((f"shared_{k}", True, k) for k in kernels(device)))
    rows = {name: host_work(batch, device, args.micro_batch_tokens, share, kernel)
            for name, share, kernel in cases if args.cases is None or name in args.cases}
    (out / "host_work.json").write_text(json.dumps({"device": str(device), "args": vars(args), "rows": rows}, indent=2))
    print(f"host work on the micro-batches ({args.prompts} prompts x {args.samples} samples x "
          f"{args.prompt_tokens}+{args.response_tokens} tokens, {device}), ms: before the first / all")
    for name, row in rows.items():
        print(f"  {name}: {row['host_before_first_ms']:.1f} / {row['host_all_ms']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention-repeats", type=int, default=20)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-speed", action="store_true", help="no training steps (parity and attention only)")
    parser.add_argument("--profile", action="store_true", help="kernel profile of one shared step (GPU)")
    parser.add_argument("--cases", type=lambda v: v.split(","), default=None,
                        help="training steps of these rows only (padded, shared_varlen, shared_rows, shared_fa4; "
                             "default all)")
    parser.add_argument("--trial-tokens", type=int, default=transformer.TRIAL_TOKENS,
                        help="tokens of the compiled layers' first call, whose sizes their kernels are tuned for (GPU)")
    parser.add_argument("--sweep-budgets", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        metavar="N[,N...]", help="after the cases, one shared-rows step per micro-batch token budget, "
                                                 "with the device's peak memory")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host's work on the micro-batches of each case (no model; any machine)")
    args = parser.parse_args()
    known = {"padded", "shared_varlen", "shared_rows", "shared_fa4", "shared_auto"}
    if args.cases is not None and not set(args.cases) <= known:
        parser.error(f"unknown --cases {sorted(set(args.cases) - known)}; known: {sorted(known)}")
    transformer.TRIAL_TOKENS = args.trial_tokens
    if args.tiny:
        args.prompts, args.samples, args.prompt_tokens, args.response_tokens = 4, 4, 8, 8
        args.micro_batch_tokens, args.steps, args.attention_repeats = 64, 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.host_only:
        host_only(device, out, args)
        return
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_parity:
            result["parity"] = parity(Path(tmp), device, dtype)
        shape = TINY_SHAPE if args.tiny else SHAPES[args.shape]
        result["attention"] = attention(device, dtype, shape, args)
        (out / "shared_prompts.json").write_text(json.dumps(result, indent=2))
        if not args.skip_speed:
            result["speed"] = speed(Path(tmp), device, dtype, shape, args)
    (out / "shared_prompts.json").write_text(json.dumps(result, indent=2))

    p = result.get("parity")
    if p is not None:
        print(f"\nparity ({dtype}, against float32 padded rows): "
              + ", ".join(f"{k} log-prob max err {v['logprob_max_abs_err']:.2e}, grad rel err "
                          f"{v['grad_rel_err']:.2e}" for k, v in p.items() if k != "ok")
              + f" -> {'ok' if p['ok'] else 'FAILED'}")
    a = result["attention"]
    print(f"attention of one layer, forward + backward, one micro-batch ({a['shared_tokens']} packed tokens, "
          f"FLOPs at {a['matrix_tflops']:.0f} TFLOP/s: {a['flops_ms']:.3f} ms): padded {a['padded_rows']} x "
          f"{a['padded_length']} {a['padded_ms']:.3f} ms; "
          + "; ".join(f"shared, {k} {a[f'shared_{k}_ms']:.3f} ms ({a[f'shared_{k}_ms'] / a['flops_ms']:.1f}x)"
                      for k in kernels(device))
          + f"; the key gather alone {a['gather_ms']:.3f} ms")
    if "ok" in a:
        print("  errors against float32 (output, dq, dk, dv): " + "; ".join(
            f"{k} {a[f'shared_{k}_err']['out']:.1e}, " + ", ".join(f"{e:.1e}" for e in a[f"shared_{k}_err"]["grads"])
            for k in kernels(device)) + f" -> {'ok' if a['ok'] else 'FAILED'}")
    if "speed" in result:
        print(f"| rows | s/step | tokens through the layers | micro-batches | host ms: before the first / all |  "
              f"({args.prompts} prompts x {args.samples} samples x {args.prompt_tokens}+{args.response_tokens} tokens)")
        print("|---|---:|---:|---:|---:|")
        for name, row in result["speed"].items():
            if name.startswith("budget_"):
                continue
            print(f"| {name} | {row['step_s']:.3f} | {row['model_tokens']:.0f} | {row['micro_batches']:.0f} | "
                  f"{row['host_before_first_ms']:.1f} / {row['host_all_ms']:.1f} |")
        sweep = [row for name, row in result["speed"].items() if name.startswith("budget_")]
        if sweep:
            print("| micro-batch budget (tokens) | s/step | micro-batches | peak GiB |\n|---:|---:|---:|---:|")
            for row in sweep:
                if "out_of_memory" in row:
                    print(f"| {row['budget']} | out of memory | | |")
                else:
                    print(f"| {row['budget']} | {row['step_s']:.3f} | {row['micro_batches']:.0f} | "
                          f"{row.get('peak_gib', float('nan')):.1f} |")
        for kernel in ("rows", "fa4"):
            prof = result["speed"].get(f"shared_{kernel}", {}).get("profile")
            if prof is None:
                continue
            kinds = ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(prof["device_ms_by_kind"].items(), key=lambda kv: -kv[1]))
            print(f"profiled shared step ({kernel}): {prof['wall_ms']:.0f} ms wall; device time: {kinds}")
            print_idle(prof["idle"])
            for k in prof["top"]:
                print(f"    {k['ms']:8.1f} ms x{k['calls']:<5} {k['name']}")
    if (p is not None and not p["ok"]) or not a.get("ok", True):
        sys.exit(1)


if __name__ == "__main__":
    main()
