"""The decode step's products under every cuBLASLt algorithm its heuristics offer, against torch's choice.

    python bench/cublaslt_search.py --out runs/lt          # one CUDA GPU, Qwen3-1.7B shape

torch calls cuBLAS (or cuBLASLt) with the library's first heuristic choice for each shape. At 128-512
rows the Qwen3-1.7B decode products run at 38-57% of the matrix rate under that choice (BENCHMARKS.md,
"Decode products alone"); cuBLASLt's heuristics return a ranked list of algorithms (tile shapes,
K splits, cluster shapes), not one. This asks for up to ``--candidates`` of them per shape, with a
32 MiB workspace, and times each: y = x @ w.T with w stored [out, in] as the engine stores it,
calls captured in one CUDA graph over enough weight copies that L2 holds none, beside F.linear in
the same harness; the largest difference from F.linear's result is reported with each. With
``--profile`` the kernel names of F.linear's and the fastest algorithm's launches are recorded.
An experiment through ctypes on the cuBLASLt that torch loaded: the engine does not use it.
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
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed  # noqa: E402
from iteration import measure_rates  # noqa: E402

QWEN3_1_7B = {"qkv_fused": (4096, 2048), "o": (2048, 2048), "gate_up_fused": (12288, 2048), "down": (2048, 6144),
              "lm_head": (151936, 2048)}
WORKSPACE_BYTES = 32 << 20  # what Hopper's split-K and stream-K algorithms ask for at these shapes
CANDIDATES = 32  # of cuBLASLt's heuristics, best first

# cublasLt.h values (the same in CUDA 12 and 13)
_COMPUTE_32F, _R_32F, _R_16BF, _R_16F = 68, 0, 14, 2
_DESC_TRANSA, _DESC_TRANSB, _PREF_MAX_WORKSPACE_BYTES = 3, 4, 1
_OP_N, _OP_T = 0, 1
_DATA_TYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library() -> ctypes.CDLL:
    """The cuBLASLt that torch itself loaded (one product first makes it load), found by its path
    in this process's memory map: no second copy of the library, no guessed file name."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    paths = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                    if "libcublasLt" in line})
    if not paths:
        raise RuntimeError("torch has not loaded cuBLASLt in this process; cannot search its algorithms")
    return ctypes.CDLL(paths[0])


class CublasLt:
    """The few cuBLASLt calls of y[m, n] = x[m, k] @ w[n, k].T (row-major), each status checked.
    In cuBLASLt's column-major terms: y.T (n x m) = op_T(w as k x n) @ x.T (k x m)."""

    def __init__(self):
        self.lib = _loaded_library()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(self.lib.cublasLtGetVersion())
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._problems: dict[tuple, dict] = {}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def problem(self, m: int, n: int, k: int, dtype: torch.dtype) -> dict:
        key = (m, n, k, dtype)
        if key not in self._problems:
            desc = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F),
                        "cublasLtMatmulDescCreate")
            for attribute, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
                value = ctypes.c_int32(op)
                self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), 4),
                            "cublasLtMatmulDescSetAttribute")
            layouts = [self._layout(rows, cols, _DATA_TYPES[dtype]) for rows, cols in ((k, n), (k, m), (n, m))]
            self._problems[key] = dict(desc=desc, a=layouts[0], b=layouts[1], d=layouts[2])
        return self._problems[key]

    def _layout(self, rows: int, cols: int, data_type: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), data_type, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(rows)),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def candidates(self, problem: dict, count: int = CANDIDATES) -> list[Algo]:
        """cuBLASLt's heuristic algorithms for ``problem``, best first, within the workspace."""
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            size = ctypes.c_uint64(WORKSPACE_BYTES)
            self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                                      ctypes.byref(size), 8),
                        "cublasLtMatmulPreferenceSetAttribute")
            results, returned = (HeuristicResult * count)(), ctypes.c_int(0)
            p = problem
            self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, p["desc"], p["a"], p["b"], p["d"],
                                                                p["d"], pref, count, results, ctypes.byref(returned)),
                        "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Algo.from_buffer_copy(results[i].algo) for i in range(returned.value) if results[i].state == 0]

    def matmul(self, problem: dict, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
               workspace: torch.Tensor) -> None:
        p = problem
        self._check(self.lib.cublasLtMatmul(
            self.handle, p["desc"], ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), p["a"],
            ctypes.c_void_p(x.data_ptr()), p["b"], ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), p["d"],
            ctypes.c_void_p(y.data_ptr()), p["d"], ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(workspace.numel()), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
            "cublasLtMatmul")


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
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def search(lt: CublasLt, shapes: dict, batches, count: int, bandwidth: float, matrix_flops: float,
           profile_kernels: bool, save) -> list[dict]:
    """Rows per (product, batch); ``save(rows)`` after each, so that a run cut short keeps what it timed."""
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
                   torch_of_matrix_rate=flops / base / matrix_flops, candidates=timings,
                   weight_floor_us=n * k * 2 / bandwidth * 1e6, matrix_floor_us=flops / matrix_flops * 1e6)
        if best:
            row.update(best_rank=best["rank"], best_us=best["us"], best_of_matrix_rate=flops / best["us"] * 1e6
                       / matrix_flops, first_us=ok[0]["us"] if ok[0]["rank"] == 0 else None)
            if profile_kernels:
                algo = found[best["rank"]]
                row["torch_kernels"] = kernel_names(lambda: F.linear(x, ws[0]))
                row["best_kernels"] = kernel_names(lambda: lt.matmul(problem, algo, x, ws[0], y, workspace))
        rows.append(row)
        save(rows)
        print(f"{name:>14} M={m:<5} torch {base * 1e6:7.1f} us ({100 * flops / base / matrix_flops:3.0f}%)"
              + (f"  heuristic #0 {row['first_us'] or float('nan'):7.1f}  best #{best['rank']} {best['us']:7.1f} us"
                 f" ({100 * row['best_of_matrix_rate']:3.0f}%) of {len(ok)}; max diff {best['max_abs_diff']:.1e}"
                 f" {best['config']}" if best else "  no candidate ran"), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="128,256,512")
    parser.add_argument("--candidates", type=int, default=CANDIDATES)
    parser.add_argument("--weights", default=",".join(QWEN3_1_7B), help="which of the shape's products")
    parser.add_argument("--profile", action="store_true", help="record the kernels' names")
    args = parser.parse_args()
    unknown = set(args.weights.split(",")) - set(QWEN3_1_7B)
    if unknown:
        raise SystemExit(f"unknown --weights {sorted(unknown)}; the shape's products are {', '.join(QWEN3_1_7B)}")
    if not torch.cuda.is_available():
        raise SystemExit("cublaslt_search needs a CUDA GPU")
    shapes = {name: QWEN3_1_7B[name] for name in args.weights.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth, flops = measure_rates(torch.device("cuda"))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=bandwidth / 1e9,
                  matrix_tflops=flops / 1e12)
    print(f"{result['device']}: copy {bandwidth / 1e9:.0f} GB/s, matrix {flops / 1e12:.0f} TFLOP/s", flush=True)
    lt = CublasLt()
    result["cublaslt_version"] = lt.version
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows):
        (out / "cublaslt_search.json").write_text(json.dumps(dict(result, rows=rows), indent=2))

    search(lt, shapes, batches, args.candidates, bandwidth, flops, args.profile, save)


if __name__ == "__main__":
    main()
