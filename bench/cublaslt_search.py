"""The decode step's products under every cuBLASLt algorithm its heuristics offer, against torch's choice.

    python bench/cublaslt_search.py --out runs/lt          # one CUDA GPU, Qwen3-1.7B shape

torch calls cuBLAS (or cuBLASLt) with the library's first heuristic choice for each shape. At 128-512
rows the Qwen3-1.7B decode products run at 38-57% of the matrix rate under that choice (BENCHMARKS.md,
"Decode products alone"); cuBLASLt's heuristics return a ranked list of algorithms (tile shapes,
K splits, cluster shapes), not one. This asks for up to ``--candidates`` of them per shape, with the
workspace of ``engine.generate.timed_products``, and times each: y = x @ w.T with w stored [out,
in] as the engine stores it, calls captured in one CUDA graph over enough weight copies that L2
holds none, beside F.linear in the same harness; the largest difference from F.linear's result is
reported with each. With ``--profile`` the kernel names of F.linear's and the fastest algorithm's
launches are recorded.
The engine's ``cublaslt-timed`` products choose among the same candidates.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed  # noqa: E402
from iteration import measure_rates  # noqa: E402

from shardflow.engine.generate.timed_products import WORKSPACE_BYTES, CublasLt  # noqa: E402

QWEN3_1_7B = {"qkv_fused": (4096, 2048), "o": (2048, 2048), "gate_up_fused": (12288, 2048), "down": (2048, 6144),
              "lm_head": (151936, 2048)}
CONFIG_ATTRIBUTES = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                     "inner_shape": 7, "cluster": 8}  # cublasLtMatmulAlgoConfigAttributes_t


def algo_config(lt: CublasLt, algo) -> dict:
    """The configuration attributes the algorithm reports (each size asked first: a get with the
    wrong size fails)."""
    out = {}
    get = lt.lib.cublasLtMatmulAlgoConfigGetAttribute
    for name, attribute in CONFIG_ATTRIBUTES.items():
        size, value = ctypes.c_size_t(0), ctypes.c_uint64(0)
        if get(ctypes.byref(algo), attribute, None, 0, ctypes.byref(size)) != 0 or not 0 < size.value <= 8:
            continue
        if get(ctypes.byref(algo), attribute, ctypes.byref(value), size.value, ctypes.byref(size)) == 0:
            out[name] = value.value
    return out


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def search(lt: CublasLt, shapes: dict, batches, count: int, bandwidth: float, matrix_flops: float,
           profile_kernels: bool) -> list[dict]:
    rows, workspace = [], torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for (name, (n, k)), m in itertools.product(shapes.items(), batches):
        copies = max(1, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        reference = F.linear(x, ws[0]).float()
        calls = max(1, 20 // copies)
        base = kernel_timed(lambda: [F.linear(x, w) for w in ws], torch.device("cuda"), calls=calls) / copies
        problem = lt.problem(m, n, k, torch.bfloat16)
        found = lt.candidates(problem, count)
        timings = []
        for rank, algo in enumerate(found):
            try:
                lt.matmul(problem, algo, x, ws[0], y, workspace)
                error = (y.float() - reference).abs().max().item()
                seconds = kernel_timed(lambda a=algo: [lt.matmul(problem, a, x, w, y, workspace) for w in ws],
                                       torch.device("cuda"), calls=calls) / copies
            except RuntimeError as e:
                timings.append(dict(rank=rank, error=str(e)[:200]))
                continue
            timings.append(dict(rank=rank, us=seconds * 1e6, max_abs_diff=error, config=algo_config(lt, algo)))
        ok = [t for t in timings if "us" in t]
        best = min(ok, key=lambda t: t["us"]) if ok else None
        flops = 2 * m * n * k
        row = dict(weight=name, batch=m, n=n, k=k, torch_us=base * 1e6,
                   torch_of_matrix_rate=flops / base / matrix_flops, candidates=timings, weight_floor_us=n * k * 2 / bandwidth * 1e6,
                   matrix_floor_us=flops / matrix_flops * 1e6)
        if best:
            row.update(best_rank=best["rank"], best_us=best["us"], best_of_matrix_rate=flops / best["us"] * 1e6
                       / matrix_flops, first_us=ok[0]["us"] if ok[0]["rank"] == 0 else None)
            if profile_kernels:
                algo = found[best["rank"]]
                row["torch_kernels"] = kernel_names(lambda: F.linear(x, ws[0]))
                row["best_kernels"] = kernel_names(lambda: lt.matmul(problem, algo, x, ws[0], y, workspace))
        rows.append(row)
        print(f"{name:>14} M={m:<5} torch {base * 1e6:7.1f} us ({100 * flops / base / matrix_flops:3.0f}%)"
              + (f"  heuristic #0 {row['first_us'] or float('nan'):7.1f}  best #{best['rank']} {best['us']:7.1f} us"
                 f" ({100 * row['best_of_matrix_rate']:3.0f}%) of {len(ok)}; max diff {best['max_abs_diff']:.1e}"
                 f" {best['config']}" if best else "  no candidate ran"), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="128,256,512")
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--weights", default=",".join(QWEN3_1_7B), help="which of the shape's products")
    parser.add_argument("--profile", action="store_true", help="record the kernels' names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublaslt_search needs a CUDA GPU")
    shapes = {name: QWEN3_1_7B[name] for name in args.weights.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth, flops = measure_rates(torch.device("cuda"))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=bandwidth / 1e9,
                  matrix_tflops=flops / 1e12)
    print(f"{result['device']}: copy {bandwidth / 1e9:.0f} GB/s, matrix {flops / 1e12:.0f} TFLOP/s", flush=True)
    result["rows"] = search(CublasLt(), shapes, batches, args.candidates, bandwidth, flops, args.profile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cublaslt_search.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
