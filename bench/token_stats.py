"""Log-probabilities and entropy of training logits: the fused kernels against plain torch ops.

    python bench/token_stats.py --out runs/bench-token-stats          # GPU: 16K tokens x 152K vocabulary, bf16
    python bench/token_stats.py --out runs/bench-token-stats --tiny   # any machine: checks it runs

One micro-batch of a Qwen3 training call (16,384 tokens, vocabulary 151,936, bf16 logits): forward
(log p of the targets, entropy) and backward (gradient of a weighted sum of both) through
``head_logprobs_and_entropy``, once with the Triton kernels and once with the same math in torch
ops (what runs on CPU). Checks that both agree, and reports ms and GB/s of each against the copy
bandwidth; the fused kernels' floor is one read of the logits forward and one read plus one write
of their gradient backward. Prints a table and writes ``token_stats.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import measure_bandwidth, timed  # noqa: E402

from shardflow.models import token_stats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    n, v = (256, 5000) if tiny else (16384, 151936)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(n, v, generator=g, device=device)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    w_lp, w_h = torch.randn(n, generator=g, device=device), torch.randn(n, generator=g, device=device)
    bandwidth = measure_bandwidth(device, 0.25 if tiny else 4.0)
    item = logits.element_size()

    def run(fused: bool, backward: bool = True):
        """What ``head_logprobs_and_entropy``'s forward and backward do, with one implementation."""
        stats_fn, grad_fn = ((token_stats.local_stats_triton, token_stats.grad_triton) if fused else
                             (token_stats.local_stats_torch, token_stats.grad_torch))
        log_z, lp, h = token_stats.combine(stats_fn(logits, targets, 0, 1.0), None)
        return lp, h, grad_fn(logits, targets, 0, 1.0, log_z, h, w_lp, w_h) if backward else None

    rows, results = [], {}
    variants = [("torch ops", False)] + ([("fused (Triton)", True)] if device.type == "cuda" else [])
    for name, fused in variants:
        results[name] = run(fused)
        seconds = timed(lambda: run(fused), device, repeat=5)
        forward_s = timed(lambda: run(fused, backward=False), device, repeat=5)
        floor = 3 * n * v * item  # read forward, read + write backward
        rows.append(dict(variant=name, ms=seconds * 1e3, forward_ms=forward_s * 1e3, floor_ms=floor / bandwidth * 1e3,
                         forward_floor_ms=n * v * item / bandwidth * 1e3, gb_per_s=floor / seconds / 1e9))
    check = {}
    if len(results) == 2:
        (lp0, h0, g0), (lp1, h1, g1) = results.values()
        check = dict(logprob_max_abs_diff=float((lp0 - lp1).abs().max()), entropy_max_abs_diff=float((h0 - h1).abs().max()),
                     grad_max_abs_diff=float((g0.float() - g1.float()).abs().max()))
    print(f"{n} tokens x {v} vocabulary, {dtype}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| variant | ms (forward + backward) | floor ms | effective GB/s | forward ms (its floor) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | {r['gb_per_s']:.0f} | "
              f"{r['forward_ms']:.2f} ({r['forward_floor_ms']:.2f}) |")
    if check:
        print("agreement: " + ", ".join(f"{k} {val:.2e}" for k, val in check.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "token_stats.json").write_text(json.dumps(dict(tokens=n, vocab=v, dtype=str(dtype),
                                                          bandwidth_gb_s=bandwidth / 1e9, rows=rows, check=check), indent=2))
    # bf16 logits: log-probabilities of size ~10 agree to float32 rounding of sums over 152K terms
    if check and not (check["logprob_max_abs_diff"] < 1e-2 and check["entropy_max_abs_diff"] < 1e-2
                      and check["grad_max_abs_diff"] < 1e-2):
        sys.exit("the fused kernels disagree with the torch ops")


if __name__ == "__main__":
    main()
