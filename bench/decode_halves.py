"""Decode steps in two halves on two streams against whole steps (``generation.overlap_min_rows``).

    python bench/decode_halves.py --out runs/decode-halves            # one GPU, Qwen3-1.7B shape
    python bench/decode_halves.py --out runs/decode-halves --tiny     # CPU check (halves in sequence)

For each ``batch x context`` case the engine's decode step (compiled, CUDA graphs, paged cache,
prompts of ``--prompt-tokens`` shared by ``--samples-per-prompt`` samples, sampled at
``--temperature``) runs whole, then as two halves whose attention and products overlap: the
median wall time per step over ``--steps`` steps once the rows reach ``context`` positions, and
whether the two pick the same tokens (the halves' products run at half the rows, so their
rounding may differ: the share of tokens equal, and of rows equal from their first token to the
last, are reported, not asserted). The step's floor in the same table: its weights and its KV at
copy bandwidth, or its FLOPs at the matrix rate, whichever is longer (both overlapped), and the
two in sequence (what a whole step can reach at best). Writes ``decode_halves.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_profile import model_config  # noqa: E402
from generation import TINY, llama_config, measure_bandwidth, random_model  # noqa: E402
from iteration import measure_rates  # noqa: E402

from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.requests import SamplingParams, make_requests  # noqa: E402


def step_floor(cfg, batch: int, context: int, prompt: int, samples: int, bandwidth: float,
               matrix_rate: float, item: int) -> tuple[float, float]:
    """Seconds of a decode step at ``batch`` rows and ``context`` positions: (the larger of its
    bytes at copy bandwidth and its FLOPs at the matrix rate; the two in sequence). Bytes: every
    weight once, and the KV of each row's own positions plus each prompt's once."""
    H, d, kv, L = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.num_layers
    layer = H * d * (cfg.num_heads * 2 + 2 * kv) + 3 * H * cfg.intermediate_size
    weights = (L * layer + cfg.vocab_size * H) * item
    rows_kv = (batch * (context - prompt) + batch // samples * prompt) * L * 2 * kv * d * item
    flops = 2 * batch * (L * layer + cfg.vocab_size * H)
    products = max(weights / bandwidth, flops / matrix_rate)
    return max((weights + rows_kv) / bandwidth, flops / matrix_rate), products + rows_kv / bandwidth


def run_case(model, device, batch: int, context: int, prompt: int, samples: int, temperature: float,
             block: int | None, halves: bool, steps: int) -> dict:
    """The median decode step once the rows reach ``context`` positions, and every row's tokens."""
    compiled = device.type == "cuda"
    config = EngineConfig(max_seq_len=context + steps + 8, max_batch_size=batch, compile=compiled,
                          kv_block_size=block, overlap_min_rows=batch if halves else 0)
    engine = GenerationEngine(model, config, eos_token_ids=[])
    warm = 1 + context - prompt  # the prefill's token, then decode up to the context
    params = SamplingParams(max_new_tokens=warm + steps, temperature=temperature, seed=0, ignore_eos=True)
    prompts = [[5 + (i % 90)] * prompt for i in range(batch // samples)]
    requests = make_requests(prompts, params, samples_per_prompt=samples)
    engine.submit(requests)
    for _ in range(warm):
        engine.step()
    engine.flush()
    engine.stats.decode_steps.clear()
    engine.generate([])  # the rest of the steps, to the end of every request
    times = sorted(s for _, s in engine.stats.decode_steps)
    engine.release_cache()
    return dict(step_us=times[len(times) // 2] * 1e6, timed_steps=len(times),
                tokens=[r.output_ids for r in requests])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", choices=("llama-3.1-8b", "qwen3-1.7b"), default="qwen3-1.7b")
    parser.add_argument("--cases", default="256x320,128x320,512x320,256x1024", help="batch x context, comma-separated")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kv-block-size", type=int, default=64, help="0: the contiguous cache")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = llama_config(TINY) if args.tiny else model_config(args.model)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    prompt = args.prompt_tokens
    if args.tiny:
        cases, prompt = [(8, 24)], 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": "tiny" if args.tiny else args.model, "cases": []}
    if device.type == "cuda":
        result["bandwidth_gb_s"] = measure_bandwidth(device, 4) / 1e9
        result["matrix_tflops"] = measure_rates(device)[1] / 1e12
    model = random_model(cfg, device, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    for batch, context in cases:
        if batch % args.samples_per_prompt or not 0 < prompt < context:
            raise ValueError(f"case {batch}x{context}: the batch must be a multiple of --samples-per-prompt and the "
                             f"context longer than --prompt-tokens {prompt}")
        whole, halves = (run_case(model, device, batch, context, prompt, args.samples_per_prompt, args.temperature,
                                  args.kv_block_size or None, h, args.steps) for h in (False, True))
        equal = sum(a == b for x, y in zip(whole["tokens"], halves["tokens"]) for a, b in zip(x, y))
        total = sum(len(x) for x in whole["tokens"])
        row = dict(batch=batch, context=context, whole_us=whole["step_us"], halves_us=halves["step_us"],
                   ratio=halves["step_us"] / whole["step_us"], timed_steps=whole["timed_steps"],
                   tokens_equal=equal / total,
                   rows_equal=sum(x == y for x, y in zip(whole["tokens"], halves["tokens"])) / batch)
        if device.type == "cuda":
            overlapped, in_sequence = step_floor(cfg, batch, context, prompt, args.samples_per_prompt,
                                                 result["bandwidth_gb_s"] * 1e9, result["matrix_tflops"] * 1e12, item)
            row.update(floor_us=overlapped * 1e6, in_sequence_floor_us=in_sequence * 1e6)
        result["cases"].append(row)
        (out / "decode_halves.json").write_text(json.dumps(result, indent=2))  # kept if cut short
    (out / "decode_halves.json").write_text(json.dumps(result, indent=2))
    print(f"{'case':>10} {'whole us':>9} {'halves us':>9} {'ratio':>6} {'floor us':>9} {'in sequence':>11} "
          f"{'tokens equal':>12} {'rows equal':>10}")
    for r in result["cases"]:
        floors = f"{r['floor_us']:9.0f} {r['in_sequence_floor_us']:11.0f}" if "floor_us" in r else f"{'':9} {'':11}"
        print(f"{r['batch']:>4}x{r['context']:<5} {r['whole_us']:9.1f} {r['halves_us']:9.1f} {r['ratio']:6.3f} "
              f"{floors} {r['tokens_equal']:12.3f} {r['rows_equal']:10.3f}")


if __name__ == "__main__":
    main()
