"""Where a decode step's time goes, to guide tuning (a diagnostic, not a headline benchmark).

    python bench/decode_profile.py --out runs/decode-profile            # one GPU, LLaMA-3.1-8B shape
    python bench/decode_profile.py --out runs/decode-profile --tiny     # CPU check

1. With ``--sweep``: the Triton decode attention per batch x context case over its split count at
   the engine's knobs, then over positions per block, warps and pipeline stages at the split count
   the engine picks; GB/s of KV read (about 80 kernel compilations per model shape: minutes).
2. The decode step's projections alone per weight shape, under cuBLAS and cuBLASLt, and under
   cuBLAS with the weight stored transposed (with ``--autotune`` also inductor's max-autotune
   choice), GB/s of weight read and share of the matrix rate, at ``--linear-batches`` (1, 16, 64, 256).
3. A kernel-level profile (torch.profiler) of the engine's compiled decode step (and with
   ``--eager`` the eager one) at batch 1 and 64: the top kernels by device time.
Writes ``decode_profile.json`` to ``--out`` and prints the best settings found.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import LLAMA_8B, TINY, kernel_timed, llama_config, measure_bandwidth, random_model  # noqa: E402
from iteration import SHAPES, measure_rates  # noqa: E402

from shardflow.engine.generate.decode_attention import (  # noqa: E402
    BLOCK_N,
    MAX_SPLITS,
    NUM_STAGES,
    NUM_WARPS,
    PROGRAMS_PER_SM,
    decode_attention_triton,
    num_splits,
)
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.requests import SamplingParams, make_requests  # noqa: E402

ENGINE_KNOBS = (BLOCK_N, PROGRAMS_PER_SM, NUM_WARPS, NUM_STAGES)  # what the engine runs


def model_config(name: str):
    """The model shape: LLaMA-3.1-8B (generation's) or Qwen3-1.7B (the GRPO iteration's)."""
    if name == "llama-3.1-8b":
        return llama_config(LLAMA_8B)
    from transformers import Qwen3Config

    from shardflow.config.model import ModelConfig

    hf = Qwen3Config(**SHAPES["qwen3-1.7b"], rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    hf.architectures = ["Qwen3ForCausalLM"]
    return ModelConfig.from_hf_dict(hf.to_dict())


def attention_sweep(device, cfg, cases, dtype) -> list[dict]:
    """Per batch x context case: the split count at the engine's knobs (1 to 32 splits, and what
    ``num_splits`` picks), then the other knobs at the picked split count; microseconds per call
    of 20 calls in one CUDA graph (no launch overhead), split and merge kernels together."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    heads = cfg.num_heads
    block, _, warps, stages = ENGINE_KNOBS
    rows = []
    for batch, context in cases:
        k = torch.randn(batch + 1, kv, context + 1, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, d, dtype=dtype, device=device)
        slots = torch.arange(batch, device=device)
        lengths = torch.full((batch,), context, device=device)
        nbytes = 2 * batch * kv * context * d * k.element_size()
        picked = num_splits(batch, kv, context + 1, device)
        most = min(MAX_SPLITS, -(-context // block))
        grid = [(block, warps, stages, n) for n in sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n <= most}
                                                          | {picked})]
        grid += [(b, w, st, picked) for b, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
                 if (b, w, st) != (block, warps, stages)]
        for b, w, st, n in grid:
            row = dict(batch=batch, context=context, block=b, warps=w, stages=st, splits=n, picked=n == picked)
            try:
                seconds = kernel_timed(lambda: decode_attention_triton(q, k, v, slots, lengths, None, block=b,
                                                                       num_warps=w, num_stages=st, splits=n), device)
            except Exception as e:  # noqa: BLE001 - a config may not compile (shared memory)
                rows.append(row | dict(error=str(e)[:200]))
                continue
            rows.append(row | dict(us=seconds * 1e6, gbps=nbytes / seconds / 1e9))
        del k, v
    return rows


def linear_sweep(device, cfg, dtype, batches=(1, 16, 64, 256), autotune: bool = False,
                 matrix_flops: float | None = None) -> list[dict]:
    """Each decode projection per weight shape and batch: ``F.linear`` under cuBLAS and cuBLASLt
    (the weight [out, in], as the engine stores it), and under cuBLAS with the weight stored
    transposed ([in, out], ``x @ w``), which makes cuBLAS pick other kernels; with ``autotune``
    also inductor's ``max-autotune`` choice among its Triton matrix-product templates and cuBLAS.
    Microseconds per call of calls in one CUDA graph over enough copies of the weight that L2
    cannot hold them (the decode step reads each weight once per step); with ``matrix_flops``,
    the share of that rate each reaches."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv_fused": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up_fused": (2 * I, H),
              "down": (H, I), "lm_head": (cfg.vocab_size, H)}
    variants = (("cublas", "out_in"), ("cublaslt", "out_in"), ("cublas", "in_out"))
    if autotune:
        variants += (("max-autotune", "out_in"),)
    chosen = torch.backends.cuda.preferred_blas_library()
    rows = []
    for (name, (n, kdim)), batch, (library, layout) in itertools.product(shapes.items(), batches, variants):
        copies = max(1, -(-256 * 2**20 // (n * kdim * 2)))  # >= 256 MiB, five times the L2
        shape = (n, kdim) if layout == "out_in" else (kdim, n)
        ws = [torch.randn(*shape, dtype=dtype, device=device) for _ in range(copies)]
        x = torch.randn(batch, kdim, dtype=dtype, device=device)
        if library == "max-autotune":  # one compilation per shape, tuned on the first copy
            linear = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            product = lambda w, linear=linear: linear(x, w)  # noqa: E731
        else:
            product = (lambda w: F.linear(x, w)) if layout == "out_in" else (lambda w: x @ w)
        torch.backends.cuda.preferred_blas_library("cublas" if library == "max-autotune" else library)
        try:
            seconds = kernel_timed(lambda: [product(w) for w in ws], device, calls=max(1, 20 // copies)) / copies
        finally:
            torch.backends.cuda.preferred_blas_library(chosen)
        row = dict(weight=name, batch=batch, library=library, layout=layout, us=seconds * 1e6,
                   gbps=ws[0].numel() * ws[0].element_size() / seconds / 1e9)
        if matrix_flops:
            row["of_matrix_rate"] = 2 * batch * n * kdim / seconds / matrix_flops
        rows.append(row)
        del ws
    return rows


def kernel_profile(model, device, batch: int, context: int, compile: bool, temperature: float,
                   samples: int = 1, prompt: int | None = None, kv_block_size: int | None = None,
                   combo_kernels: bool = True) -> dict:
    """Top kernels of 10 decode steps at ``batch`` rows and ``context`` positions: ``batch /
    samples`` prompts of ``prompt`` tokens (default ``context``) with ``samples`` samples each
    (one prefill per prompt, as GRPO groups have), decoded up to ``context`` before profiling.
    Also the device time per step (all kernels), and the wall time per step of the same steps
    replayed as CUDA graphs (what the engine runs): their difference is launch gaps and host time."""
    from torch.profiler import ProfilerActivity, profile

    prompt = prompt or context
    if batch % samples or not 0 < prompt <= context:
        raise ValueError(f"batch {batch} must be a multiple of samples {samples}, prompt {prompt} in [1, {context}]")
    warm = 8 + context - prompt  # prefill, then decode (and compile) up to the context
    params = SamplingParams(max_new_tokens=warm + 20, temperature=temperature, seed=0, ignore_eos=True)
    prompts = [[5 + (i % 90)] * prompt for i in range(batch // samples)]

    def engine_at_context(graphs: bool) -> GenerationEngine:
        engine = GenerationEngine(model, EngineConfig(max_seq_len=context + 64, max_batch_size=batch, cuda_graphs=graphs,
                                                      compile=compile, kv_block_size=kv_block_size,
                                                      combo_kernels=combo_kernels), eos_token_ids=[])
        engine.submit(make_requests(prompts, params, samples_per_prompt=samples))
        for _ in range(warm):
            engine.step()
        torch.cuda.synchronize(device)
        return engine

    warm_compiler(device)
    compiled_before = len(compilation_metrics())
    engine = engine_at_context(graphs=False)
    compiles = [dict(function=m.co_name, seconds=float(m.entire_frame_compile_time_s or 0.0))
                for m in compilation_metrics()[compiled_before:]]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    engine.evict()
    engine.release_cache()
    graph_us = None
    if compile:  # the engine's path: compiled and replayed as graphs
        engine = engine_at_context(graphs=True)
        engine.stats.decode_steps.clear()
        for _ in range(10):
            engine.step()
        engine.flush()
        graph_us = sorted(s for _, s in engine.stats.decode_steps)[len(engine.stats.decode_steps) // 2] * 1e6
        engine.evict()
        engine.release_cache()
    kernels = [dict(name=e.key[:120], calls=e.count, us_per_step=e.device_time_total / 10,
                    share=e.device_time_total / total) for e in events[:40]]
    return dict(kernels=kernels, device_us_per_step=total / 10, graph_us_per_step=graph_us,
                kernels_per_step=sum(e.count for e in events) / 10, compiles=compiles)


def compilation_metrics() -> list:
    """dynamo's record of each frame it compiled in this process (function name, seconds), in order;
    [] where this torch keeps none."""
    return list(getattr(torch._dynamo.utils, "get_compilation_metrics", lambda: [])())


def warm_compiler(device) -> None:
    """One trivial compilation, so that the compiler's own start (its worker processes, the first
    kernel's toolchain) is not charged to the decode step's first function, as in a run where
    training's layers compiled first."""
    torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=device))


def sampler_times(device, cfg) -> list[dict]:
    """The sampler alone per batch and mode, us per call: as the decode step calls it (on GPUs the
    one-pass Triton kernel) and the torch candidates compiled by inductor (what the step ran
    before the kernel), with whether the two pick the same tokens and how far their
    log-probabilities are apart."""
    from shardflow.engine.generate.sampling import (
        GREEDY,
        SAMPLE,
        SamplingTensors,
        local_candidates,
        pick,
        sample,
        scaled_logits,
    )

    compiled = torch.compile(local_candidates, dynamic=True) if device.type == "cuda" else local_candidates
    rows = []
    for batch, mode in itertools.product((1, 64, 256), (GREEDY, SAMPLE)):
        logits = torch.randn(batch, cfg.vocab_size, dtype=torch.bfloat16, device=device)
        st = SamplingTensors(temperature=torch.full((batch,), 1.0 if mode == SAMPLE else 0.0, device=device),
                             top_k=torch.zeros(batch, dtype=torch.long, device=device),
                             top_p=torch.ones(batch, device=device),
                             seed=torch.arange(batch, device=device), position=torch.full((batch,), 7, device=device))
        ours = lambda: sample(logits, st, vocab_start=0, vocab_size=cfg.vocab_size, group=None, mode=mode)  # noqa: E731
        torch_ops = lambda: pick(compiled(scaled_logits(logits, st.temperature), st, 0, mode)[None])  # noqa: E731
        (t_ours, lp_ours), (t_torch, lp_torch) = ours(), torch_ops()
        s, s_torch = kernel_timed(ours, device), kernel_timed(torch_ops, device)
        rows.append(dict(batch=batch, mode=mode, us=s * 1e6, torch_us=s_torch * 1e6,
                         gbps=logits.numel() * logits.element_size() / s / 1e9,
                         same_tokens=bool(torch.equal(t_ours, t_torch)),
                         max_logprob_diff=float((lp_ours - lp_torch).abs().max())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode attention's knobs")
    parser.add_argument("--eager", action="store_true", help="also profile the eager decode step")
    parser.add_argument("--sweep-cases", default="1x8192,16x1024,64x1024,64x8192,256x1024",
                        help="batch x context cases of the sweep, comma-separated")
    parser.add_argument("--sweep-only", action="store_true",
                        help="only the sweeps (attention and projections): no sampler, no profile")
    parser.add_argument("--linear-only", action="store_true", help="only the projection sweep")
    parser.add_argument("--profile-only", action="store_true",
                        help="only the kernel profile: no projection sweep, no sampler")
    parser.add_argument("--linear-batches", default="1,16,64,256", help="batches of the projection sweep")
    parser.add_argument("--autotune", action="store_true",
                        help="the projection sweep also times inductor's max-autotune choice (minutes)")
    parser.add_argument("--model", choices=("llama-3.1-8b", "qwen3-1.7b"), default="llama-3.1-8b")
    parser.add_argument("--kv-block-size", type=int, default=0,
                        help="profile the engine with a paged KV cache of blocks of this many tokens (0: contiguous)")
    parser.add_argument("--profile-cases", default="1x1024,64x1024",
                        help="batch x context cases of the kernel profile, comma-separated")
    parser.add_argument("--samples-per-prompt", type=int, default=1,
                        help="rows per prompt in the kernel profile (GRPO groups share their prompt's prefill)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length of the kernel profile (default: the context; decoded up to it)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the profiled steps (0 = greedy; GRPO samples at 1)")
    parser.add_argument("--no-combo-kernels", action="store_true",
                        help="the profiled step compiled without inductor's combo kernels (the engine's default uses them)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("decode_profile measures GPU kernels; on CPU it only checks that it runs")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = llama_config(TINY) if args.tiny else model_config(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": "tiny" if args.tiny else args.model}
    if device.type == "cuda":
        result["bandwidth_gb_s"] = measure_bandwidth(device, 4) / 1e9
        cases = [tuple(int(x) for x in case.split("x")) for case in args.sweep_cases.split(",")]
        sweep_attention = (args.sweep or args.sweep_only) and not args.linear_only
        result["attention"] = attention_sweep(device, cfg, cases, dtype) if sweep_attention else []
        (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
        result["matrix_tflops"] = measure_rates(device)[1] / 1e12
        batches = tuple(int(b) for b in args.linear_batches.split(","))
        result["linear"] = [] if args.profile_only else linear_sweep(
            device, cfg, dtype, batches, args.autotune, result["matrix_tflops"] * 1e12)
        only = args.sweep_only or args.linear_only
        result["sampler"] = [] if only or args.profile_only else sampler_times(device, cfg)
        model = None if only else random_model(cfg, device, dtype)
        result["profile"] = {}
        profile_cases = [tuple(int(x) for x in case.split("x")) for case in args.profile_cases.split(",")]
        for (b, c), comp in itertools.product(() if only else profile_cases,
                                              (True, False) if args.eager else (True,)):
            key = f"b{b}_ctx{c}_{'compiled' if comp else 'eager'}"
            try:
                result["profile"][key] = kernel_profile(model, device, b, c, comp, args.temperature,
                                                            args.samples_per_prompt, args.prompt_tokens,
                                                            args.kv_block_size or None, not args.no_combo_kernels)
            except Exception as e:  # noqa: BLE001 - keep the other measurements
                result["profile"][key] = dict(kernels=[], error=f"{type(e).__name__}: {e}"[:300])
            (out / "decode_profile.json").write_text(json.dumps(result, indent=2))  # kept if cut short
    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    if device.type == "cuda":
        print_summary(result)


def print_summary(result: dict) -> None:
    """The measurements of ``result`` (as written to decode_profile.json), one line each."""
    knobs = (ENGINE_KNOBS[0], ENGINE_KNOBS[2], ENGINE_KNOBS[3])
    for batch, context in sorted({(r["batch"], r["context"]) for r in result["attention"]}):
        ok = [r for r in result["attention"] if r["batch"] == batch and r["context"] == context and "us" in r]
        best = min(ok, key=lambda r: r["us"])
        picked = next(r for r in ok if r["picked"] and (r["block"], r["warps"], r["stages"]) == knobs)
        by_splits = " ".join(f"{r['splits']}:{r['us']:.1f}" for r in ok if (r["block"], r["warps"], r["stages"]) == knobs)
        print(f"attention b{batch} ctx{context}: picked {picked['splits']} splits {picked['us']:.1f} us "
              f"({picked['gbps']:.0f} GB/s); best {best['us']:.1f} us (block {best['block']} warps {best['warps']} "
              f"stages {best['stages']} splits {best['splits']}); us by splits {by_splits}")
    for r in result["linear"]:
        rate = f", {100 * r['of_matrix_rate']:4.0f}% of the matrix rate" if "of_matrix_rate" in r else ""
        print(f"linear {r['weight']:>14} b{r['batch']:<3} {r['library']:>12} {r['layout']:>6} {r['us']:8.1f} us "
              f"{r['gbps']:6.0f} GB/s{rate}")
    for r in result["sampler"]:
        print(f"sampler b{r['batch']:<3} {r['mode']:>6} {r['us']:8.1f} us ({r['gbps']:5.0f} GB/s of bf16 logits), "
              f"torch ops compiled {r['torch_us']:8.1f} us; same tokens {r['same_tokens']}, "
              f"log-probs within {r['max_logprob_diff']:.1e}")
    for key, prof in result["profile"].items():
        if "error" in prof:
            print(f"-- {key}: failed: {prof['error']}")
            continue
        graph = f", {prof['graph_us_per_step']:.1f} us per step as CUDA graphs" if prof["graph_us_per_step"] else ""
        print(f"-- {key}: {prof['device_us_per_step']:.1f} us of kernels per step ({prof['kernels_per_step']:.0f} "
              f"kernels){graph}; top kernels (us per step)")
        if prof.get("compiles"):
            print(f"   compiled (s): " + ", ".join(f"{c['function']} {c['seconds']:.2f}" for c in prof["compiles"]))
        for r in prof["kernels"]:
            print(f"   {r['us_per_step']:8.1f} {100 * r['share']:5.1f}% x{r['calls'] // 10:<4} {r['name']}")


if __name__ == "__main__":
    main()
