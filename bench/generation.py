"""Decode speed of the generation engine against the memory roofline and ``transformers``.

    python bench/generation.py --out runs/bench          # one GPU: LLaMA-3.1-8B shape, bf16
    python bench/generation.py --out runs/bench --tiny   # any machine: a tiny shape (CPU check)

In one run, on one device:
1. HBM bandwidth, measured with a large device copy (bytes read + written per second);
2. a parity check on tiny random LLaMA and Qwen3 models: the fast path (CUDA graphs, Triton decode attention,
   torch.compile unless --no-compile) against the plain path (eager, torch attention) on the same
   device, greedy: float32 tokens must be identical; in bfloat16 every fast-path token must be the
   plain path's argmax up to bf16 rounding (a top-2 margin below BF16_TIE counts as a tie); and
   in float32 a sampled run whose batch shrinks and refills (``shrinking_parity``);
3. the Triton decode attention alone (20 calls per CUDA graph replay, so that launch overhead
   does not count): achieved GB/s reading the KV cache;
4. the engine on random weights of the model shape, forced output length (EOS ignored), for each
   batch size x context: ms per decode step, achieved GB/s, and the roofline
   (weight bytes + KV bytes read per step) / measured bandwidth;
5. ``transformers`` ``generate`` on the same weights, ms per decode step, for a few of the cases.
Prints a table and writes ``generation.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardflow.config.experiment import BLAS_LIBRARIES, COMPILE_MODES  # noqa: E402
from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.engine.generate.decode_attention import ATTENTION  # noqa: E402
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.kv_cache import bytes_per_slot  # noqa: E402
from shardflow.engine.generate.requests import SamplingParams, make_requests  # noqa: E402
from shardflow.models.transformer import build_model  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
BF16_TIE = 0.15  # logits of the tiny model are O(1-10); bf16 keeps ~3 significant digits


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_timed(fn, device: torch.device, calls: int = 20, repeat: int = 5) -> float:
    """Seconds per call of ``fn`` with no launch overhead: on CUDA, ``calls`` calls captured in one
    graph, median of ``repeat`` replays; elsewhere ``timed``."""
    if device.type != "cuda":
        return timed(fn, device, repeat)
    fn()  # compile and warm up outside the capture
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, device, repeat) / calls


def measure_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second of a large device-to-device copy (each byte read once, written once)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeat=10)
    del src, dst
    return 2 * n / seconds


def llama_config(shape: dict) -> ModelConfig:
    from transformers import LlamaConfig

    hf = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf.architectures = ["LlamaForCausalLM"]
    return ModelConfig.from_hf_dict(hf.to_dict())


@torch.no_grad()
def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The whole model on one device with random weights made in place (no checkpoint)."""
    shard = shard_for(cfg, Layout((0,)), 0)
    model = build_model(cfg, shard, None, device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model


# ----- parity: fast path against plain path --------------------------------------------------------

def parity_check(device: torch.device, compile_: bool, options: dict) -> dict:
    """``options``: the fast path's other EngineConfig fields (compile mode, BLAS library, weight layout)."""
    from shardflow.models.checkpoint import load_model
    from shardflow.models.tiny import make_tiny_checkpoint
    from shardflow.parallel.world import World

    fast = dict(attention="triton" if device.type == "cuda" else "torch", cuda_graphs=device.type == "cuda",
                compile=compile_, **options)
    plain = dict(attention="torch", cuda_graphs=False, compile=False)
    world = World(rank=0, size=1, device=device, backend="nccl" if device.type == "cuda" else "gloo")
    lengths = (3, 17, 40, 9)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    results = {}
    # LLaMA greedy and sampled; Qwen3 (q/k norms, the GRPO benchmark's family) greedy
    runs = [("llama", dtype, (0.0, 1.0)) for dtype in (torch.float32, torch.bfloat16)]
    runs += [("qwen3", dtype, (0.0,)) for dtype in (torch.float32, torch.bfloat16)]
    with tempfile.TemporaryDirectory() as tmp:
        for family, dtype, temperatures in runs:
            path = make_tiny_checkpoint(Path(tmp) / family, family)
            model, _ = load_model(path, Layout((0,)), world, dtype=dtype)
            for temperature in temperatures:  # greedy, then sampled with per-request seeds
                params = SamplingParams(max_new_tokens=48, temperature=temperature, seed=7, ignore_eos=True)
                outputs, seeds = {}, None
                for name, options in (("plain", plain), ("fast", fast)):
                    engine = GenerationEngine(model, EngineConfig(max_seq_len=128, max_batch_size=8, **options))
                    requests = engine.generate(make_requests(prompts, params))
                    outputs[name], seeds = [r.output_ids for r in requests], [r.seed for r in requests]
                    del engine
                same = sum(a == b for x, y in zip(outputs["plain"], outputs["fast"]) for a, b in zip(x, y))
                total = sum(len(x) for x in outputs["plain"])
                worst = worst_margin(model, prompts, outputs["fast"], seeds, temperature)
                ok = same == total if dtype == torch.float32 else worst <= BF16_TIE
                key = f"{str(dtype).removeprefix('torch.')} {'greedy' if temperature == 0 else 'sampled'}"
                key = key if family == "llama" else f"{family} {key}"
                results[key] = dict(identical_tokens=same, tokens=total, worst_argmax_margin=worst, ok=ok)
            if dtype == torch.float32 and family == "llama":
                results["float32 sampled, shrinking batch"] = shrinking_parity(model, plain, fast)
            del model
    return results


def shrinking_parity(model, plain: dict, fast: dict) -> dict:
    """The path RL runs take and forced lengths never do: groups of samples sharing their prompt's
    prefill, rows leaving at different steps (length limits and a stop token), more requests than
    the batch holds (admissions mid-run, freed slots reused), so that the fast path changes batch
    buckets, compacts rows and captures graphs mid-run. float32 tokens, log-probabilities and
    finish reasons must equal the plain path's."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 25, 5)]
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=11, stop_token_ids=(7,))
              for n in (48, 7, 30, 13, 21, 40)]
    runs = {}
    for name, options in (("plain", plain), ("fast", fast)):
        engine = GenerationEngine(model, EngineConfig(max_seq_len=128, max_batch_size=8, **options))
        runs[name] = [(r.output_ids, r.finish_reason, r.output_logprobs)
                      for r in engine.generate(make_requests(prompts, params, samples_per_prompt=3))]
        del engine
    same = sum(a == b for (x, _, _), (y, _, _) in zip(runs["plain"], runs["fast"]) for a, b in zip(x, y))
    total = sum(len(x) for x, _, _ in runs["plain"])
    lengths_match = all(len(x) == len(y) and fx == fy for (x, fx, _), (y, fy, _) in zip(runs["plain"], runs["fast"]))
    logprob_diff = max((abs(a - b) for (_, _, x), (_, _, y) in zip(runs["plain"], runs["fast"]) for a, b in zip(x, y)),
                       default=0.0)
    return dict(identical_tokens=same, tokens=total, worst_argmax_margin=0.0, finish_reasons_match=lengths_match,
                max_logprob_diff=logprob_diff, ok=same == total and lengths_match and logprob_diff < 1e-4)


@torch.no_grad()
def worst_margin(model, prompts: list[list[int]], completions: list[list[int]], seeds: list[int],
                 temperature: float) -> float:
    """Largest (max score - score of the chosen token) along the fast path's own sequences, by a
    plain full forward: 0 when every chosen token is the plain path's choice. The score is the
    logit (greedy), or logit / T plus the request's Gumbel noise, a pure function of its seed, the
    token's position and the vocabulary index (sampled)."""
    from shardflow.engine.generate.sampling import gumbel_noise

    worst = 0.0
    device = next(model.parameters()).device
    for prompt, completion, seed in zip(prompts, completions, seeds):
        ids = torch.tensor([prompt + completion], device=device)
        hidden = model(ids, torch.arange(ids.shape[1], device=device)[None])
        score = model.logits(hidden[0, len(prompt) - 1: -1]).float()[:, : model.cfg.vocab_size]  # [n, V]
        if temperature > 0:
            positions = torch.arange(len(prompt), len(prompt) + len(completion), device=device)
            score = score / temperature + gumbel_noise(torch.full_like(positions, seed), positions,
                                                       torch.arange(score.shape[-1], device=device))
        chosen = score.gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0]
        worst = max(worst, float((score.max(-1).values - chosen).max()))
    return worst


# ----- the decode attention kernel alone ------------------------------------------------------------

def bench_attention(cfg: ModelConfig, device: torch.device, cases: list[tuple[int, int]], bandwidth: float) -> list:
    rows = []
    attention = ATTENTION["triton" if device.type == "cuda" else "torch"]
    kv_heads, d = cfg.num_kv_heads, cfg.head_dim
    for batch, context in cases:
        k = torch.randn(batch + 1, kv_heads, context, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, cfg.num_heads, d, device=device, dtype=torch.bfloat16)
        slots = torch.arange(batch, device=device)
        lengths = torch.full((batch,), context, device=device)
        seconds = kernel_timed(lambda: attention(q, k, v, slots, lengths, None), device)
        nbytes = 2 * batch * kv_heads * context * d * 2
        rows.append(dict(batch=batch, context=context, us=seconds * 1e6, gb_per_s=nbytes / seconds / 1e9,
                         fraction_of_bandwidth=nbytes / seconds / bandwidth))
        del k, v
    return rows


# ----- the engine on the model shape ----------------------------------------------------------------

def bench_engine(engine: GenerationEngine, cfg: ModelConfig, batch: int, context: int, steps: int, bandwidth: float,
                 item: int) -> dict:
    """The engine's cache sized for ``batch`` requests of ``context + steps`` positions (whole
    blocks of a paged cache, plus its scratch block)."""
    max_seq_len = context + steps + 1
    per_slot = bytes_per_slot(engine.model.shard, cfg, max_seq_len - 1, engine.dtype)
    block = engine.config.kv_block_size
    if block:
        per_slot = per_slot // (max_seq_len - 1) * block * -(-(max_seq_len - 1) // block)
    engine.reset_cache(max_seq_len=max_seq_len, kv_cache_bytes=(batch + 1) * per_slot)
    g = torch.Generator().manual_seed(batch * 7 + context)
    prompts = [torch.randint(3, cfg.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
    requests = make_requests(prompts, SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.stats.decode_steps.clear()
    start = time.perf_counter()
    engine.generate(requests)
    wall = time.perf_counter() - start
    times = [s for b, s in engine.stats.decode_steps]
    assert len(times) == steps and all(b == batch for b, _ in engine.stats.decode_steps)
    step = statistics.median(times[3:])  # the first steps include graph capture (and compilation)
    weight_bytes = (cfg.num_params() - cfg.embedding_params()) * item + batch * cfg.hidden_size * item
    mean_len = context + steps / 2 + 1  # positions attended per request, averaged over the steps
    kv_bytes = batch * mean_len * cfg.kv_bytes_per_token(item)
    roofline = (weight_bytes + kv_bytes) / bandwidth
    return dict(batch=batch, context=context, ms_per_step=step * 1e3, tokens_per_s=batch / step,
                gb_per_s=(weight_bytes + kv_bytes) / step / 1e9, roofline_ms=roofline * 1e3,
                vs_roofline=step / roofline, first_step_ms=times[0] * 1e3, wall_s=wall)


@torch.no_grad()
def bench_transformers(model, cfg: ModelConfig, device: torch.device, cases: list[tuple[int, int]],
                       steps: int) -> list:
    """``transformers`` ``generate`` (greedy, forced length) on the same weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_cfg = LlamaConfig(**cfg.hf_config)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=next(model.parameters()).dtype).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    rows = []
    for batch, context in cases:
        ids = torch.randint(3, cfg.vocab_size, (batch, context), device=device)

        def run(n: int):
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)

        one = timed(lambda: run(1), device, repeat=2)
        many = timed(lambda: run(steps + 1), device, repeat=2)
        rows.append(dict(batch=batch, context=context, ms_per_step=(many - one) / steps * 1e3))
    del hf
    return rows


# ----- main -----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for generation.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (for CPU)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per case")
    parser.add_argument("--hf-steps", type=int, default=None, help="decode steps of transformers per case")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the decode step (default: on GPU only)")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                        help="torch.compile mode of the decode step; other than default, every batch size "
                             "compiles for its own static shapes (autotuned kernels are chosen per shape)")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="set torch._inductor.config's KEY to a Python literal before compiling, e.g. "
                             "combo_kernels=True or coordinate_descent_tuning=True (repeatable)")
    parser.add_argument("--blas-library", choices=BLAS_LIBRARIES, default=None,
                        help="the BLAS library of the engine's decode products (default: torch's)")
    parser.add_argument("--transposed-weights", action="store_true",
                        help="the engine's decode products read their weights stored transposed ([in, out])")
    parser.add_argument("--share-prompt-kv", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's decode attention reads a prompt once for the samples prefilled together "
                             "(the parity check's groups of samples; the engine cases have one sample per prompt)")
    parser.add_argument("--skip-transformers", action="store_true", help="do not measure transformers generate")
    parser.add_argument("--skip-parity", action="store_true", help="do not check the fast path against the plain one")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    shape = TINY if tiny else LLAMA_8B
    batches = [int(b) for b in (args.batches or ("1,4" if tiny else "1,16,64,256")).split(",")]
    contexts = [int(c) for c in (args.contexts or ("64,256" if tiny else "1024,8192")).split(",")]
    steps = args.steps or (8 if tiny else 32)
    hf_steps = args.hf_steps or (4 if tiny else 16)
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    item = torch.empty((), dtype=dtype).element_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__, dtype=str(dtype), shape=shape, compile=compile_,
                        compile_mode=args.compile_mode, blas_library=args.blas_library,
                        transposed_weights=args.transposed_weights, share_prompt_kv=args.share_prompt_kv, steps=steps)
    options = dict(compile_mode=args.compile_mode, blas_library=args.blas_library,
                   transposed_weights=args.transposed_weights, share_prompt_kv=args.share_prompt_kv)
    if args.compile_mode != "default":
        torch._dynamo.config.automatic_dynamic_shapes = False
    for setting in args.inductor:  # before any work, so that a bad key costs nothing
        key, _, value = setting.partition("=")
        try:
            setattr(torch._inductor.config, key, ast.literal_eval(value))
        except (AttributeError, ValueError, SyntaxError) as e:
            parser.error(f"--inductor {setting}: {e}")
    report["inductor"] = args.inductor
    t0 = time.perf_counter()

    def save() -> None:  # after every section, so a run cut short still leaves what it measured
        report["seconds"] = time.perf_counter() - t0
        (out / "generation.json").write_text(json.dumps(report, indent=2))

    report["bandwidth_gb_per_s"] = measure_bandwidth(device, 0.25 if tiny else 4.0) / 1e9
    bandwidth = report["bandwidth_gb_per_s"] * 1e9
    print(f"device {report['device']}: copy bandwidth {report['bandwidth_gb_per_s']:.0f} GB/s")

    report["parity"] = {}
    if not args.skip_parity:
        try:
            report["parity"] = parity_check(device, compile_, options)
        except Exception as e:  # noqa: BLE001 - a failed compilation is reported, then measured without
            if not compile_:
                raise
            report["compile_error"] = f"{type(e).__name__}: {e}"
            print(f"torch.compile failed, measuring without it: {report['compile_error'][:500]}")
            compile_ = report["compile"] = False
            report["parity"] = parity_check(device, compile_, options | dict(compile_mode="default"))
    for name, p in report["parity"].items():
        print(f"parity {name}: {p['identical_tokens']}/{p['tokens']} tokens identical to the plain path, "
              f"worst argmax margin {p['worst_argmax_margin']:.3g} -> {'ok' if p['ok'] else 'FAILED'}")
    save()

    print(f"[{time.perf_counter() - t0:.0f}s] decode attention alone")
    cfg = llama_config(shape)
    cases = list(dict.fromkeys([(1, max(contexts)), (64, max(contexts)), (max(batches), min(contexts))]))
    report["attention"] = bench_attention(cfg, device, cases, bandwidth)
    for row in report["attention"]:
        print(f"decode attention batch {row['batch']:>3} context {row['context']:>5}: {row['us']:8.1f} us "
              f"{row['gb_per_s']:7.1f} GB/s ({row['fraction_of_bandwidth']:.0%} of copy bandwidth)")
    save()

    print(f"[{time.perf_counter() - t0:.0f}s] engine on random weights (compile={compile_})")
    model = random_model(cfg, device, dtype)
    engine = GenerationEngine(model, EngineConfig(max_seq_len=max(contexts) + steps + 1, max_batch_size=max(batches),
                                        kv_cache_bytes=(2 * bytes_per_slot(model.shard, cfg, max(contexts) + steps,
                                                                           dtype)),
                                        compile=compile_, **options))
    rows, skipped = report["engine"], report["skipped"] = [], []
    for context in contexts:
        for batch in batches:
            need = (batch + 1) * bytes_per_slot(model.shard, cfg, context + steps, dtype)
            engine.release_cache()
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
            if need > free - (4 << 30):  # room for prefill activations and sampling
                skipped.append(dict(batch=batch, context=context, reason=f"KV cache of {need / 2**30:.0f} GiB does "
                                    f"not fit in {free / 2**30:.0f} GiB free"))
                print(f"skip batch {batch} context {context}: {skipped[-1]['reason']}")
                continue
            row = bench_engine(engine, cfg, batch, context, steps, bandwidth, item)
            rows.append(row)
            print(f"batch {batch:>3} context {context:>5}: {row['ms_per_step']:7.2f} ms/step "
                  f"{row['gb_per_s']:6.1f} GB/s, roofline {row['roofline_ms']:6.2f} ms "
                  f"({row['vs_roofline']:.2f}x), {row['tokens_per_s']:8.0f} tokens/s")
            save()
    engine.release_cache()
    del engine

    hf_cases = [] if args.skip_transformers else list(dict.fromkeys(
        [(1, min(contexts)), (min(16, max(batches)), min(contexts)), (1, max(contexts))]))
    if hf_cases:
        print(f"[{time.perf_counter() - t0:.0f}s] transformers generate")
    report["transformers"] = bench_transformers(model, cfg, device, hf_cases, hf_steps) if hf_cases else []
    for row in report["transformers"]:
        ours = next((r for r in rows if (r["batch"], r["context"]) == (row["batch"], row["context"])), None)
        row["speedup"] = row["ms_per_step"] / ours["ms_per_step"] if ours else None
        print(f"transformers batch {row['batch']:>3} context {row['context']:>5}: {row['ms_per_step']:7.2f} ms/step"
              + (f" (engine speedup {row['speedup']:.1f}x)" if ours else ""))
    save()
    print_table(report)
    print(f"wrote {out / 'generation.json'} in {report['seconds']:.0f}s")
    if not all(p["ok"] for p in report["parity"].values()):
        sys.exit("parity check FAILED: the fast path disagrees with the plain path")


def print_table(report: dict) -> None:
    hf = {(r["batch"], r["context"]): r["ms_per_step"] for r in report["transformers"]}
    print()
    print("| context | batch | ms/step | GB/s | roofline ms | x roofline | tokens/s | transformers ms/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["engine"]:
        t = hf.get((r["batch"], r["context"]))
        print(f"| {r['context']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['gb_per_s']:.0f} | "
              f"{r['roofline_ms']:.2f} | {r['vs_roofline']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{'' if t is None else f'{t:.1f}'} |")
    for r in report["skipped"]:
        print(f"| {r['context']} | {r['batch']} | skipped: {r['reason']} | | | | | |")


if __name__ == "__main__":
    main()
