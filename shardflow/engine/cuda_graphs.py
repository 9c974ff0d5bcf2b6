"""Decode steps captured as CUDA graphs, one per batch-size bucket and sampling mode.

A decode step reads its inputs from fixed device buffers: ``ints`` [5, B] (tokens, positions,
slots, top_k, seeds) and ``floats`` [2, B] (temperatures, top_p). A batch of B requests runs the
graph of the smallest bucket >= B, its extra rows filled with a dummy request that lives in the
KV cache's scratch slot (position 0, greedy), so padding never touches a real request's cache.
Graphs are captured on first use, in the order batches arrive; every tp rank sees the same batch
sizes in the same order, so the collectives inside the graphs match across ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

# step(ints [5,B], floats [2,B], mode) -> (tokens [B], logprobs [B]), all on the device
StepFn = Callable[[torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
INT_ROWS, FLOAT_ROWS = 5, 2


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch]


def dummy_rows(scratch_slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` padding rows: token 0 at position 0 of the scratch slot, greedy."""
    ints = torch.zeros(INT_ROWS, n, dtype=torch.int64)
    ints[2] = scratch_slot
    floats = torch.zeros(FLOAT_ROWS, n, dtype=torch.float32)
    floats[1] = 1.0
    return ints, floats


class GraphedDecode:
    """Runs ``step`` through CUDA graphs captured per (bucket, mode)."""

    def __init__(self, step: StepFn, *, max_batch: int, scratch_slot: int, device: torch.device):
        self.step, self.device = step, device
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot = scratch_slot
        n = self.buckets[-1]
        self.ints = torch.zeros(INT_ROWS, n, dtype=torch.int64, device=device)
        self.floats = torch.zeros(FLOAT_ROWS, n, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run concurrently)

    def bucket(self, batch: int) -> int:
        return next(n for n in self.buckets if n >= batch)

    def __call__(self, ints: torch.Tensor, floats: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """ints [5,B], floats [2,B] on the host -> (tokens [B], logprobs [B]) on the device."""
        batch = ints.shape[1]
        n = self.bucket(batch)
        key = (n, mode)
        if key not in self.graphs:
            self._capture(n, mode)
        pad_ints, pad_floats = dummy_rows(self.scratch_slot, n - batch)
        self.ints[:, :n].copy_(torch.cat([ints, pad_ints], 1))
        self.floats[:, :n].copy_(torch.cat([floats, pad_floats], 1))
        self.graphs[key].replay()
        tokens, logprobs = self.outputs[key]
        return tokens[:batch], logprobs[:batch]

    def _capture(self, n: int, mode: str) -> None:
        # Warm up (and let torch.compile, if used, compile) on dummy rows only: they write the
        # scratch slot, never a real request's cache.
        pad_ints, pad_floats = dummy_rows(self.scratch_slot, n)
        self.ints[:, :n].copy_(pad_ints)
        self.floats[:, :n].copy_(pad_floats)
        ints, floats = self.ints[:, :n], self.floats[:, :n]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(ints, floats, mode)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the NCCL watchdog) do not break the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.step(ints, floats, mode)
        self.pool = graph.pool()
        self.graphs[(n, mode)], self.outputs[(n, mode)] = graph, out
