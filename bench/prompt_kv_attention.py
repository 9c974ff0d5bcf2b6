"""Decode attention that reads a GRPO group's prompt KV once, against reading every row's copy: the
engine's kernel with and without ``prompts``, alone, per CUDA-graph replay, on the GRPO iteration's
shape or another.

    python bench/prompt_kv_attention.py --out runs/bench-prompt-kv            # GPU: Qwen3-1.7B shape
    python bench/prompt_kv_attention.py --out DIR --prompts 16 --prompt-tokens 1024 --contexts 1056,1280,1536
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
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed, measure_bandwidth  # noqa: E402

from shardflow.engine.generate.decode_attention import decode_attention_triton  # noqa: E402
from shardflow.perf.sharing import PROMPT_ROWS  # noqa: E402


def measure(device, dtype, prompts_n: int, samples: int, heads: int, kv_heads: int, d: int, prompt: int,
            max_len: int, contexts: list[int]) -> list[dict]:
    if samples > PROMPT_ROWS:
        raise ValueError(f"{samples} samples per prompt: one group holds at most {PROMPT_ROWS}")
    batch = prompts_n * samples
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch + 1, kv_heads, max_len, d, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    for p in range(prompts_n):  # every sample of a prompt holds the same copy of its prompt's KV
        rows = slice(p * samples, (p + 1) * samples)
        k[rows, :, :prompt] = k[p * samples, :, :prompt]
        v[rows, :, :prompt] = v[p * samples, :, :prompt]
    q = torch.randn(batch, heads, d, device=device, dtype=dtype, generator=g)
    slots = torch.arange(batch, device=device)
    groups = slots // samples  # groups of at most PROMPT_ROWS rows
    prompts = (groups, torch.full((batch,), prompt, device=device))
    results = []
    for context in contexts:
        lengths = torch.full((batch,), context, device=device, dtype=torch.int32)
        args = (q, k, v, slots, lengths, None)
        item = k.element_size()
        results.append({
            "context": context,
            "engine_us": 1e6 * kernel_timed(lambda: decode_attention_triton(*args), device),
            "cascade_us": 1e6 * kernel_timed(lambda: decode_attention_triton(*args, prompts), device),
            "engine_bytes": 2 * batch * kv_heads * context * d * item,
            "cascade_bytes": 2 * kv_heads * d * item * (prompts_n * prompt + batch * (context - prompt)),
            "max_abs_diff": (decode_attention_triton(*args).float()
                             - decode_attention_triton(*args, prompts).float()).abs().max().item(),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--contexts", default="96,192,320,448,575", help="positions per row, each a case")
    parser.add_argument("--prompts", type=int, default=32, help="prompts (groups of rows)")
    parser.add_argument("--samples", type=int, default=8, help=f"rows per prompt, at most {PROMPT_ROWS}")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="positions every row of a prompt shares")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:  # 2 prompts x 4 samples, 2 KV heads of 16, prompts of 8 positions
        shape = dict(prompts_n=2, samples=4, heads=4, kv_heads=2, d=16, prompt=8, max_len=40)
        contexts = [12, 39]
    else:  # Qwen3-1.7B's heads; by default the GRPO iteration's 32 prompts x 8 samples, 64-token prompts
        contexts = [int(c) for c in args.contexts.split(",")]
        if min(contexts) <= args.prompt_tokens:
            raise ValueError(f"--contexts {args.contexts}: every context must exceed --prompt-tokens "
                             f"{args.prompt_tokens} (a row decodes past its prompt)")
        shape = dict(prompts_n=args.prompts, samples=args.samples, heads=16, kv_heads=8, d=128,
                     prompt=args.prompt_tokens, max_len=max(576, max(contexts) + 1))
    rows = measure(device, dtype, **shape, contexts=contexts)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "shape": shape, "rows": rows}
    if device.type == "cuda":
        result["bandwidth_gb_s"] = measure_bandwidth(device, 4) / 1e9
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_kv_attention.json").write_text(json.dumps(result, indent=2))

    print(f"| context | engine us | cascade us | engine GB/s | cascade GB/s | max abs diff |  ({shape['prompts_n']} prompts "
          f"x {shape['samples']} samples, {shape['prompt']}-position prompts, {dtype})")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['engine_us']:.1f} | {r['cascade_us']:.1f} | {r['engine_bytes'] / r['engine_us'] / 1e3:.0f}"
              f" | {r['cascade_bytes'] / r['cascade_us'] / 1e3:.0f} | {r['max_abs_diff']:.1e} |")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(f"mean over the contexts: engine {mean('engine_us'):.1f} us, cascade {mean('cascade_us'):.1f} us "
          f"({mean('cascade_us') / mean('engine_us'):.3f}x)"
          + (f"; copy bandwidth {result['bandwidth_gb_s']:.0f} GB/s" if "bandwidth_gb_s" in result else ""))


if __name__ == "__main__":
    main()
