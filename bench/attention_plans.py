"""Causal attention's first call at a shape against its later calls: cuDNN's kernel builds a plan for
every new shape, which is why rows of attention are padded to multiples on GPUs
(``models.packed_attention.LENGTH_MULTIPLE``).

    python bench/attention_plans.py --out runs/bench-plans          # GPU: Qwen3 heads, the iterations' shapes
    python bench/attention_plans.py --out runs/bench-plans --tiny   # any machine

Forward and backward of ``scaled_dot_product_attention`` (causal, 16 query and 8 KV heads of 128,
bf16 on GPU) over R rows of L positions, three calls per shape, wall time with the device
synchronised: shapes of the two GRPO iteration workloads' micro-batches and neighbours of them.
Prints a table and writes ``attention_plans.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = ((31, 576), (32, 576), (31, 577), (31, 578), (15, 1224), (16, 1224), (15, 1230), (28, 600), (28, 640),
          (30, 640))
TINY_SHAPES = ((2, 16), (2, 17), (3, 16))


def call_ms(rows: int, length: int, heads: int, kv_heads: int, head_dim: int, device: torch.device,
            dtype: torch.dtype) -> float:
    q = torch.randn(rows, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, head_dim = (4, 2, 16) if args.tiny else (16, 8, 128)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    for _ in range(2):  # the library's own first use, at a shape not measured
        call_ms(8, 256 if not args.tiny else 8, heads, kv_heads, head_dim, device, dtype)
    rows = [{"rows": r, "length": n, "calls_ms": [call_ms(r, n, heads, kv_heads, head_dim, device, dtype)
                                                  for _ in range(3)]} for r, n in shapes]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_plans.json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "dtype": str(dtype), "heads": [heads, kv_heads, head_dim],
         "shapes": rows}, indent=2))
    print(f"\ncausal attention forward + backward, {heads} query / {kv_heads} KV heads of {head_dim}, {name}")
    print("| rows x length | first call ms | second | third |")
    print("|---|---:|---:|---:|")
    for row in rows:
        first, second, third = row["calls_ms"]
        print(f"| {row['rows']} x {row['length']} | {first:.2f} | {second:.2f} | {third:.2f} |")


if __name__ == "__main__":
    main()
