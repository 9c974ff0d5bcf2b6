"""The decode step's fused small-batch products (shardflow/engine/gemv.py) against cuBLAS.

    python bench/gemv.py --out runs/bench-gemv          # one GPU, LLaMA-3.1-8B shapes
    python bench/gemv.py --out runs/bench-gemv --tiny   # any machine: checks the script runs

For each product of a decode layer (q/k/v with the input norm, o with the residual add, gate/up
with the norm and SiLU, down with the residual add) at batch 1, 2, 4, 8: microseconds per call
(20 calls per CUDA graph replay) of the fused kernel, of cuBLAS's ``F.linear`` alone (which leaves
the norm, SiLU and add to other kernels), and GB/s of weight read against the measured copy
bandwidth. With ``--sweep``, the kernel's knobs (rows per program, K block, warps, stages) at
batch 1 and 8 first. Checks every result against the unfused torch ops. Writes ``gemv.json``.
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

from generation import kernel_timed, measure_bandwidth  # noqa: E402

from shardflow.engine import gemv as G  # noqa: E402

LLAMA_8B = dict(hidden=4096, qkv=6144, inter=14336)
TINY = dict(hidden=64, qkv=96, inter=160)


def products(shape: dict, dtype, device) -> dict[str, dict]:
    """name -> (x, weight, fused options); weights random, scaled like trained ones."""
    H, Q, I = shape["hidden"], shape["qkv"], shape["inter"]

    def w(n, k):
        return (torch.randn(n, k, device=device) / k**0.5).to(dtype)

    gamma = (1 + 0.1 * torch.randn(H, device=device)).to(dtype)
    return {"qkv+norm": dict(weight=w(Q, H), k=H, n=Q, opts=dict(norm_weight=gamma, eps=1e-5)),
            "o+residual": dict(weight=w(H, H), k=H, n=H, opts=dict(residual=True)),
            "gate_up+norm+silu": dict(weight=w(2 * I, H), k=H, n=I, opts=dict(norm_weight=gamma, eps=1e-5,
                                                                                swiglu=True)),
            "down+residual": dict(weight=w(H, I), k=I, n=H, opts=dict(residual=True))}


def call(p: dict, batch: int, device, dtype):
    x = torch.randn(batch, p["k"], device=device).to(dtype)
    opts = dict(p["opts"])
    if opts.pop("residual", False):
        opts["residual"] = torch.randn(batch, p["n"], device=device).to(dtype)
    return x, opts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else LLAMA_8B
    prods = products(shape, dtype, device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape,
              "bandwidth_gb_s": measure_bandwidth(device, 4 if device.type == "cuda" else 0.05) / 1e9,
              "defaults": {"batch 1": G.KNOBS_1, "batch 2-8": G.KNOBS_8}, "sweep": [], "rows": []}
    # (rows per program, K block, warps, stages) per batch; batch 8 runs on tensor cores (rows >= 16)
    knobs = {1: ((4, 8, 16), (512, 1024, 2048), (4, 8), (2, 4)),
             8: ((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))} if args.sweep else {}
    for name, p in prods.items():
        for batch in knobs:
            x, opts = call(p, batch, device, dtype)
            nbytes = p["weight"].numel() * p["weight"].element_size()
            for knob in itertools.product(*knobs[batch]):
                try:
                    s = kernel_timed(lambda: G.gemv(x, p["weight"], **opts, knobs=knob), device)
                except Exception as e:  # noqa: BLE001 - a config may not compile
                    result["sweep"].append(dict(product=name, batch=batch, knobs=knob, error=str(e)[:160]))
                    continue
                result["sweep"].append(dict(product=name, batch=batch, knobs=knob, us=s * 1e6, gbps=nbytes / s / 1e9))
    for name, p in prods.items():
        nbytes = p["weight"].numel() * p["weight"].element_size()
        for batch in (1, 2, 4, 8):
            x, opts = call(p, batch, device, dtype)
            got, want = G.gemv(x, p["weight"], **opts), G.gemv_reference(x, p["weight"], **opts)
            err = ((got.float() - want.float()).abs() / (want.float().abs() + 1.0)).max().item()
            fused = kernel_timed(lambda: G.gemv(x, p["weight"], **opts), device)
            xin = torch.randn(batch, p["k"], device=device).to(dtype)
            cublas = kernel_timed(lambda: F.linear(xin, p["weight"]), device)
            result["rows"].append(dict(product=name, batch=batch, fused_us=fused * 1e6, cublas_us=cublas * 1e6,
                                       fused_gbps=nbytes / fused / 1e9, cublas_gbps=nbytes / cublas / 1e9,
                                       max_rel_err=err))
    (out / "gemv.json").write_text(json.dumps(result, indent=2))
    bw = result["bandwidth_gb_s"]
    if result["sweep"]:
        for name, batch in itertools.product(prods, (1, 8)):
            ok = [r for r in result["sweep"] if r["product"] == name and r["batch"] == batch and "us" in r]
            best = sorted(ok, key=lambda r: r["us"])[:3]
            for r in best:
                print(f"sweep {name:>18} b{batch}: {r['us']:7.1f} us {r['gbps']:5.0f} GB/s  knobs {r['knobs']}")
    print(f"\ncopy bandwidth {bw:.0f} GB/s; us per call (GB/s of weight read)")
    print(f"{'product':>18} {'batch':>5} {'fused':>16} {'cuBLAS alone':>16} {'rel err':>8}")
    for r in result["rows"]:
        print(f"{r['product']:>18} {r['batch']:>5} {r['fused_us']:8.1f} ({r['fused_gbps']:5.0f}) "
              f"{r['cublas_us']:8.1f} ({r['cublas_gbps']:5.0f}) {r['max_rel_err']:8.1e}")
    bad = [r for r in result["rows"] if r["max_rel_err"] > (0.02 if dtype == torch.bfloat16 else 1e-4)]
    if bad:
        sys.exit(f"fused products disagree with the torch ops: {bad}")


if __name__ == "__main__":
    main()
