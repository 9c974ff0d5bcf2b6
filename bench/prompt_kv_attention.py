"""Decode attention that reads a GRPO group's prompt KV once, against reading every row's copy: the
engine's kernel with and without ``prompts``, alone, per CUDA-graph replay, on the GRPO iteration's
shape or another.

    python bench/prompt_kv_attention.py --out runs/bench-prompt-kv            # GPU: Qwen3-1.7B shape
    python bench/prompt_kv_attention.py --out DIR --prompts 16 --prompt-tokens 1024 --contexts 1056,1280,1536
    python bench/prompt_kv_attention.py --out DIR --block-size 64 --sweep   # the engine's paged cache; knobs
    TRITON_INTERPRET=1 python bench/prompt_kv_attention.py --out DIR --tiny   # CPU: checks it runs

The samples of a prompt hold identical copies of the prompt's keys and values (one prefill, copied
into every sample's slot). Without ``prompts`` the kernel reads every row's copy. With them (the
cascade): a prompt kernel per (group, KV head) reads the prompt's positions once from one slot and
computes the online-softmax state of all its samples' query heads at once, and the split kernel
continues from that state over each row's own positions. KV bytes fall by the prompt's share of
each context, and so do the split kernel's iterations.

Prints, per context (all rows at the same length, as with forced lengths), us per call of each
and the output difference, and the mean over the contexts (the decode steps of the iteration go
through them evenly); writes ``prompt_kv_attention.json`` to ``--out``. (Until commit b4d898b the
cascade's kernels lived in this script; the engine runs them with ``share_prompt_kv``.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed, measure_bandwidth  # noqa: E402

from shardflow.engine.generate.decode_attention import (  # noqa: E402
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    decode_attention_torch,
    decode_attention_triton,
)
from shardflow.perf.sharing import PROMPT_ROWS  # noqa: E402


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int, g: torch.Generator, samples: int, prompt: int):
    """Slots [R, K, L, d] -> caches [S, K, block_size, d] and a block table [R, L / block_size]
    that lists each row's blocks, the blocks of all rows in a random order through the caches; as
    in the engine's paged cache, the samples of a prompt (groups of ``samples`` rows) share the
    blocks that the prompt fills (one copy, the first row's), and each has its own from there."""
    rows, kv_heads, length, d = k.shape
    n = length // block_size
    order = torch.randperm(rows * n, generator=g, device=k.device)  # order[i]: where logical block i lies

    def blocked(c):
        out = torch.empty_like(c).view(rows * n, kv_heads, block_size, d)
        out[order] = c.view(rows, kv_heads, n, block_size, d).transpose(1, 2).reshape(rows * n, kv_heads, block_size, d)
        return out

    table = order.view(rows, n).clone()
    full = prompt // block_size
    leaders = torch.arange(rows, device=k.device) // samples * samples
    table[:, :full] = table[leaders, :full]
    return blocked(k), blocked(v), table


def measure(device, dtype, prompts_n: int, samples: int, heads: int, kv_heads: int, d: int, prompt: int,
            max_len: int, contexts: list[int], block_size: int = 0, knobs: list[tuple[int, int, int]] = ()) -> dict:
    """Per context, the engine's kernel without and with ``prompts``; per knob setting (positions per
    inner step, warps, stages), the cascade's mean over the contexts."""
    if samples > PROMPT_ROWS:
        raise ValueError(f"{samples} samples per prompt: one group holds at most {PROMPT_ROWS}")
    batch = prompts_n * samples
    if block_size:
        max_len = -(-max_len // block_size) * block_size
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch + 1, kv_heads, max_len, d, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    for p in range(prompts_n):  # every sample of a prompt holds the same copy of its prompt's KV
        rows = slice(p * samples, (p + 1) * samples)
        k[rows, :, :prompt] = k[p * samples, :, :prompt]
        v[rows, :, :prompt] = v[p * samples, :, :prompt]
    q = torch.randn(batch, heads, d, device=device, dtype=dtype, generator=g)
    slots = torch.arange(batch, device=device)
    if block_size:
        k, v, table = paged(k, v, block_size, g, samples, prompt)
        slots = table[:batch].contiguous()
    groups = torch.arange(batch, device=device) // samples  # groups of at most PROMPT_ROWS rows
    prompts = (groups, torch.full((batch,), prompt, device=device))
    item = k.element_size()
    results, cascade_bytes = [], []
    for context in contexts:
        lengths = torch.full((batch,), context, device=device, dtype=torch.int32)
        args = (q, k, v, slots, lengths, None)
        cascade_bytes.append(2 * kv_heads * d * item * (prompts_n * prompt + batch * (context - prompt)))
        results.append({
            "context": context,
            "engine_us": 1e6 * kernel_timed(lambda: decode_attention_triton(*args), device),
            "cascade_us": 1e6 * kernel_timed(lambda: decode_attention_triton(*args, prompts), device),
            "engine_bytes": 2 * batch * kv_heads * context * d * item,
            "cascade_bytes": cascade_bytes[-1],
            "max_abs_diff": (decode_attention_triton(*args).float()
                             - decode_attention_triton(*args, prompts).float()).abs().max().item(),
            "max_abs_diff_torch": (decode_attention_torch(*args).float()
                                   - decode_attention_triton(*args, prompts).float()).abs().max().item(),
        })
    sweep = []
    for block, warps, stages in knobs:
        row = {"block": block, "warps": warps, "stages": stages}
        try:
            us = [1e6 * kernel_timed(lambda: decode_attention_triton(
                q, k, v, slots, torch.full((batch,), c, device=device, dtype=torch.int32), None, prompts, block=block,
                num_warps=warps, num_stages=stages), device) for c in contexts]
        except Exception as e:  # noqa: BLE001 - a setting may not compile (shared memory)
            sweep.append(row | {"error": str(e)[:200]})
            continue
        sweep.append(row | {"us": us, "mean_us": sum(us) / len(us), "bytes": sum(cascade_bytes) / len(contexts)})
    return {"rows": results, "sweep": sweep}


def read_bandwidth(device, gib: float) -> float:
    """Bytes per second of a read-only pass over a large tensor (its sum)."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    seconds = kernel_timed(lambda: x.sum(dtype=torch.float32), device, calls=5)
    return x.numel() * 2 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--contexts", default="96,192,320,448,575", help="positions per row, each a case")
    parser.add_argument("--prompts", type=int, default=32, help="prompts (groups of rows)")
    parser.add_argument("--samples", type=int, default=8, help=f"rows per prompt, at most {PROMPT_ROWS}")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="positions every row of a prompt shares")
    parser.add_argument("--block-size", type=int, default=0, help="positions per cache block (0: one slot per row)")
    parser.add_argument("--sweep", action="store_true", help="also time the cascade at other knob settings")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:  # 2 prompts x 4 samples, 2 KV heads of 16, prompts of 8 positions
        shape = dict(prompts_n=2, samples=4, heads=4, kv_heads=2, d=16, prompt=8, max_len=40)
        contexts = [12, 39]
        grid = [(16, 4, 2), (8, 2, 1)]
    else:  # Qwen3-1.7B's heads; by default the GRPO iteration's 32 prompts x 8 samples, 64-token prompts
        contexts = [int(c) for c in args.contexts.split(",")]
        if min(contexts) <= args.prompt_tokens:
            raise ValueError(f"--contexts {args.contexts}: every context must exceed --prompt-tokens "
                             f"{args.prompt_tokens} (a row decodes past its prompt)")
        shape = dict(prompts_n=args.prompts, samples=args.samples, heads=16, kv_heads=8, d=128,
                     prompt=args.prompt_tokens, max_len=max(576, max(contexts) + 1))
        grid = [knobs for knobs in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
                if knobs != (BLOCK_N, NUM_WARPS, NUM_STAGES)]
    if args.block_size < 0:
        raise ValueError(f"--block-size {args.block_size}: positions per block must be positive (0: one slot per row)")
    if args.block_size and shape["max_len"] < args.block_size:
        raise ValueError(f"--block-size {args.block_size}: longer than the cache's {shape['max_len']} positions")
    grid = [(BLOCK_N, NUM_WARPS, NUM_STAGES), *grid] if args.sweep else []
    measured = measure(device, dtype, **shape, contexts=contexts, block_size=args.block_size, knobs=grid)
    rows = measured["rows"]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "shape": shape, "block_size": args.block_size, **measured}
    if device.type == "cuda":
        result["bandwidth_gb_s"] = measure_bandwidth(device, 4) / 1e9
        result["read_bandwidth_gb_s"] = read_bandwidth(device, 4) / 1e9
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_kv_attention.json").write_text(json.dumps(result, indent=2))

    print(f"| context | engine us | cascade us | engine GB/s | cascade GB/s | max abs diff (engine, torch) |  ({shape['prompts_n']} prompts "
          f"x {shape['samples']} samples, {shape['prompt']}-position prompts, {dtype})")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['engine_us']:.1f} | {r['cascade_us']:.1f} | {r['engine_bytes'] / r['engine_us'] / 1e3:.0f}"
              f" | {r['cascade_bytes'] / r['cascade_us'] / 1e3:.0f} | {r['max_abs_diff']:.1e}, {r['max_abs_diff_torch']:.1e} |")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(f"mean over the contexts: engine {mean('engine_us'):.1f} us, cascade {mean('cascade_us'):.1f} us "
          f"({mean('cascade_us') / mean('engine_us'):.3f}x)"
          + (f"; copy bandwidth {result['bandwidth_gb_s']:.0f} GB/s, read {result['read_bandwidth_gb_s']:.0f} GB/s"
             if "bandwidth_gb_s" in result else ""))
    if result["sweep"]:
        copy = result.get("bandwidth_gb_s")
        print("| positions per step | warps | stages | cascade us, mean over the contexts | GB/s | of copy bandwidth |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in sorted(result["sweep"], key=lambda r: r.get("mean_us", float("inf"))):
            if "error" in r:
                print(f"| {r['block']} | {r['warps']} | {r['stages']} | {r['error'][:60]} | | |")
                continue
            gbps = r["bytes"] / r["mean_us"] / 1e3
            print(f"| {r['block']} | {r['warps']} | {r['stages']} | {r['mean_us']:.1f} | {gbps:.0f} | "
                  + (f"{gbps / copy:.0%} |" if copy else " |"))


if __name__ == "__main__":
    main()
