"""Decode products through the cuBLASLt algorithm that ran fastest for their shape.

torch takes the first algorithm of cuBLAS's heuristics for each product shape. At the decode
step's few hundred rows that choice runs the small products of a 1-2B model (q/k/v, o, down) at
40-55% of the matrix rate (BENCHMARKS.md, "Decode products alone"), while cuBLASLt's heuristics
rank many more candidates (tile and cluster shapes, K splits). Here a decode product of a shape
not seen before (rows, outputs, inputs) times those candidates and torch's own product once, on
its first call outside a CUDA graph capture (the engine's warm-up steps before it captures a
batch bucket), and keeps the fastest; a call during a capture of a shape not timed yet takes
torch's product.

The choices are kept in a file beside the run's compiled code (``engine.compile_cache``), per GPU
and cuBLASLt version, so that a later run takes the same algorithm for the same shape and a seed
gives the same tokens (two algorithms differ in their last bits). CUDA only; through ctypes on
the cuBLASLt library that torch has loaded.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from shardflow.engine.compile_cache import compile_cache_dir

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 32 << 20  # what Hopper's split-K and stream-K algorithms ask for at these shapes
CANDIDATES = 32  # of cuBLASLt's heuristics, best first
TIMED_CALLS, TIMED_REPEATS = 10, 3  # per candidate: calls per timing, median of repeats
COLD_BYTES = 128 << 20  # weight copies timed in turn, so that L2 holds none (as in a decode step)
TORCH = -1  # the choice "torch's own product", in the choices file

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
        raise RuntimeError("timed decode products need torch's cuBLASLt, which this process has not loaded")
    return ctypes.CDLL(paths[0])


class CublasLt:
    """The few cuBLASLt calls of y[m, n] = x[m, k] @ w[n, k].T (row-major), each status checked.
    In cuBLASLt's column-major terms: y.T (n x m) = op_T(w as k x n) @ x.T (k x m)."""

    def __init__(self):
        self.lib = _loaded_library()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
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


class TimedProducts:
    """The chosen algorithm per (device, m, n, k, dtype), timed on first sight, kept in a file."""

    def __init__(self):
        self._lt: CublasLt | None = None
        self._lock = threading.Lock()
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._choices: dict[str, list] = {}  # file key -> [candidate rank, algorithm words] or [TORCH]
        self._algos: dict[tuple, Algo | None] = {}  # (device, m, n, k, dtype) -> the choice (None: torch)
        self._names: dict[torch.device, str] = {}

    @property
    def lt(self) -> CublasLt:
        if self._lt is None:
            self._lt = CublasLt()
        return self._lt

    def _file(self) -> Path | None:
        root = compile_cache_dir()
        return None if root is None else root / "decode_products.json"

    def _key(self, device: torch.device, m: int, n: int, k: int, dtype: torch.dtype) -> str:
        if device not in self._names:
            self._names[device] = torch.cuda.get_device_name(device)
        return f"{self._names[device]}|cublasLt {self.lt.version}|{str(dtype).removeprefix('torch.')}|{m}x{n}x{k}"

    def _load(self) -> None:
        """Take the file's choices over this process's: another process (the decode step's compile
        helper, another rank) may have timed a shape since, and its choice is the one runs keep."""
        path = self._file()
        if path is None:
            return
        try:
            self._choices.update(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # a damaged file: time again, and write it anew
            logger.warning("ignoring the decode products' choices in %s: %s", path, e)

    def _save(self) -> None:
        path = self._file()
        if path is None:
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._choices, indent=1, sort_keys=True))
        tmp.replace(path)  # whole or not at all, also with several ranks writing

    def workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[device]

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [m, k] @ w[n, k].T, through the algorithm chosen for the shape (timed now if it is new
        and no graph is being captured); torch's product off CUDA and for other dtypes or strides."""
        (m, k), n = x.shape, w.shape[0]
        if not x.is_cuda or x.dtype not in _DATA_TYPES or w.dtype != x.dtype or x.stride(-1) != 1 or w.stride(-1) != 1:
            return F.linear(x, w)
        x = x if x.stride(0) == k else x.contiguous()
        w = w if w.stride(0) == k else w.contiguous()
        shape = (x.device, m, n, k, x.dtype)
        if shape not in self._algos:
            with self._lock:
                key = self._key(*shape)
                if key not in self._choices:
                    self._load()
                if key not in self._choices:
                    if torch.cuda.is_current_stream_capturing():
                        return F.linear(x, w)
                    self._choices[key] = self._time(x, w)
                    self._save()
                choice = self._choices[key]
                self._algos[shape] = None if choice[0] == TORCH else Algo((ctypes.c_uint64 * 8)(*choice[1]))
        algo = self._algos[shape]
        if algo is None:
            return F.linear(x, w)
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.lt.matmul(self.lt.problem(m, n, k, x.dtype), algo, x, w, y, self.workspace(x.device))
        return y

    def _time(self, x: torch.Tensor, w: torch.Tensor) -> list:
        """[rank, words] of the fastest candidate, or [TORCH] when none beats torch's product."""
        (m, k), n = x.shape, w.shape[0]
        problem = self.lt.problem(m, n, k, x.dtype)
        y, workspace = torch.empty(m, n, dtype=x.dtype, device=x.device), self.workspace(x.device)
        ws = [w] + [w.clone() for _ in range(-(-COLD_BYTES // (w.numel() * w.element_size())) - 1)]
        best, best_seconds = [TORCH], _seconds(lambda: [F.linear(x, c) for c in ws]) / len(ws)
        for rank, algo in enumerate(self.lt.candidates(problem)):
            try:
                seconds = _seconds(lambda a=algo: [self.lt.matmul(problem, a, x, c, y, workspace) for c in ws])
            except RuntimeError:  # a candidate the library offers but does not run here
                continue
            if seconds / len(ws) < best_seconds:
                best, best_seconds = [rank, list(algo.data)], seconds / len(ws)
        return best


def _seconds(fn) -> float:
    """Median seconds per call of ``fn`` over a few timed runs of several calls (CUDA events)."""
    fn()
    times = []
    for _ in range(TIMED_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED_CALLS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / TIMED_CALLS)
    return sorted(times)[len(times) // 2]


PRODUCTS = TimedProducts()


@torch.library.custom_op("shardflow::timed_linear", mutates_args=())
def timed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ w [n, k].T through ``PRODUCTS`` (one opaque call to torch.compile)."""
    return PRODUCTS.linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


@timed_linear.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])
