"""The decode step's small products (M = 128-512 rows) as Triton tiles of our choosing, against cuBLAS.

    python bench/decode_products_triton.py --out runs/products          # one GPU, Qwen3-1.7B shape
    TRITON_INTERPRET=1 python bench/decode_products_triton.py --out runs/products --tiny   # CPU check

cuBLAS runs q/k/v, o and down of the Qwen3-1.7B shape at 38-57% of the matrix rate at 256 rows
(BENCHMARKS.md, "Decode products alone"): its tiles leave most SMs idle. This times one Triton
product, y = x @ w.T with w stored [out, in] as the engine stores it, over a list of tile shapes
(rows, columns, depth per step, pipeline stages, warps) and K splits (partial sums added in float32,
then cast: the extra kernels are in the time), each in calls captured in one CUDA graph over enough
weight copies that L2 holds none; the largest difference from cuBLAS's result is reported beside
each. With ``--quack``, quack's CuTe DSL product (quack-kernels, where installed) in its default
tiles and its autotuned ones runs beside them. An experiment: the engine does not use these kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed  # noqa: E402
from iteration import measure_rates  # noqa: E402

# (rows, columns, depth) per tile, stages, warps, K splits
CONFIGS = [
    (64, 64, 128, 4, 4, 1), (64, 32, 128, 4, 4, 1), (32, 64, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1),
    (128, 64, 64, 4, 4, 1), (128, 64, 128, 3, 8, 1), (128, 128, 64, 4, 8, 1), (64, 64, 64, 6, 4, 1),
    (128, 32, 128, 4, 4, 1), (64, 64, 128, 4, 4, 2), (128, 64, 64, 4, 4, 2), (64, 64, 128, 4, 4, 4),
    (128, 128, 64, 4, 8, 2), (128, 256, 64, 3, 8, 1),
]
QWEN3_1_7B = {"qkv_fused": (4096, 2048), "o": (2048, 2048), "gate_up_fused": (12288, 2048), "down": (2048, 6144)}


@triton.jit
def _product_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # each split's share of K, whole steps
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * span, tl.minimum(K, (pid_k + 1) * span), BLOCK_K):
        ks = k0 + depth
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        tl.atomic_add(out, acc, mask=inside)


def triton_product(x: torch.Tensor, w: torch.Tensor, config: tuple) -> torch.Tensor:
    """x [M, K] @ w[N, K].T in the tiles of ``config``; split K sums partials in float32, then casts."""
    bm, bn, bk, stages, warps, split = config
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if split == 1 else torch.zeros(
        M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _product_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=bk, SPLIT_K=split, num_stages=stages, num_warps=warps)
    return y if split == 1 else y.to(x.dtype)


def quack_product(tuned: bool):
    from quack.gemm_interface import gemm  # optional: only where quack-kernels is installed

    return lambda x, w: gemm(x, w.T, tuned=tuned)


def sweep(device, dtype, shapes: dict, batches, configs, matrix_flops: float | None,
          libraries: dict | None = None) -> list[dict]:
    rows = []
    for (name, (n, kdim)), batch in itertools.product(shapes.items(), batches):
        copies = max(1, -(-256 * 2**20 // (n * kdim * 2))) if device.type == "cuda" else 1
        ws = [torch.randn(n, kdim, dtype=dtype, device=device) / kdim**0.5 for _ in range(copies)]
        x = torch.randn(batch, kdim, dtype=dtype, device=device)
        reference = F.linear(x, ws[0]).float()
        variants = [("cublas", None)] + [("triton", c) for c in configs] + [(name, None) for name in libraries or {}]
        for library, config in variants:
            product = (lambda w: F.linear(x, w)) if library == "cublas" else (
                lambda w, f=libraries[library]: f(x, w)) if config is None else (
                lambda w, c=config: triton_product(x, w, c))
            try:
                error = (product(ws[0]).float() - reference).abs().max().item()
                seconds = kernel_timed(lambda: [product(w) for w in ws], device,
                                       calls=max(1, 20 // copies)) / copies
            except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory
                rows.append(dict(weight=name, batch=batch, library=library, config=config,
                                 error=f"{type(e).__name__}: {e}"[:200]))
                continue
            row = dict(weight=name, batch=batch, library=library, config=config, us=seconds * 1e6,
                       max_abs_diff=error)
            if matrix_flops:
                row["of_matrix_rate"] = 2 * batch * n * kdim / seconds / matrix_flops
            rows.append(row)
        del ws
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes and two tiles (a CPU check)")
    parser.add_argument("--batches", default="128,256,512")
    parser.add_argument("--quack", action="store_true", help="also quack's product, default and autotuned tiles")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {"o": (64, 96), "down": (48, 160)} if args.tiny else QWEN3_1_7B
    configs = [(16, 16, 32, 2, 4, 1), (16, 32, 32, 2, 4, 3)] if args.tiny else CONFIGS
    batches = (8, 24) if args.tiny else tuple(int(b) for b in args.batches.split(","))
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    result["matrix_tflops"] = measure_rates(device)[1] / 1e12 if device.type == "cuda" else None
    flops = result["matrix_tflops"] * 1e12 if result["matrix_tflops"] else None
    libraries = {"quack": quack_product(False), "quack-tuned": quack_product(True)} if args.quack else None
    result["rows"] = sweep(device, dtype, shapes, batches, configs, flops, libraries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_products_triton.json").write_text(json.dumps(result, indent=2))
    for weight, batch in dict.fromkeys((r["weight"], r["batch"]) for r in result["rows"]):
        ok = [r for r in result["rows"] if (r["weight"], r["batch"]) == (weight, batch) and "us" in r]
        base = next(r for r in ok if r["library"] == "cublas")
        best = min((r for r in ok if r["library"] == "triton"), key=lambda r: r["us"])
        rate = lambda r: f" ({100 * r['of_matrix_rate']:.0f}%)" if "of_matrix_rate" in r else ""  # noqa: E731
        print(f"{weight:>14} M={batch:<4} cuBLAS {base['us']:7.1f} us{rate(base)}  best Triton {best['us']:7.1f} us"
              f"{rate(best)} {best['config']} (max diff {best['max_abs_diff']:.1e}); "
              f"failed tiles: {sum(1 for r in result['rows'] if 'error' in r and (r['weight'], r['batch']) == (weight, batch))}"
              + "".join(f"  {r['library']} {r['us']:7.1f} us{rate(r)}" for r in ok if r["library"].startswith("quack")))


if __name__ == "__main__":
    main()
