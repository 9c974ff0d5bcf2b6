"""Decode steps run from persistent device buffers, optionally replayed as CUDA graphs.

A decode step reads its inputs from fixed device buffers: ``ints`` [7, N] (tokens, positions,
slots, top_k, seeds, shared-prompt groups and their prompt lengths) and ``floats`` [2, N]
(temperatures, top_p), of which the first rows hold the batch. After sampling, the step itself
writes the next step's inputs of the same rows into the buffers (each row's sampled token, at the
next position), so that a batch whose rows do not change decodes step after step with no host work
in between: the engine launches the next step before it reads the previous one's tokens back.
When rows leave the batch, ``keep`` compacts the buffers on the device; when rows join, the
engine ``load``s them from the host.

With graphs, a batch of B requests runs the graph of the smallest bucket >= B, its extra rows
filled with a dummy request that lives in the KV cache's scratch slot (position 0, greedy; the
in-place advance leaves it there), so padding never touches a real request's cache. Graphs are
captured per (bucket, mode) on first use (the mode is whatever the step is specialised for: its
sampling mode, whether it reads shared prompts), in the order batches arrive; every tp rank sees
the same batch sizes in the same order, so the collectives inside the graphs match across ranks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, Sequence

import torch

# step(ints [7,B], floats [2,B], mode) -> (tokens [B], logprobs [B]), all on the device
Mode = Hashable
StepFn = Callable[[torch.Tensor, torch.Tensor, Mode], tuple[torch.Tensor, torch.Tensor]]
INT_ROWS, FLOAT_ROWS = 7, 2
TOKENS, POSITIONS, SLOTS, PROMPT_GROUPS = 0, 1, 2, 5  # rows of ``ints``


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two from 2 below ``max_batch``, then ``max_batch`` itself. One row runs as two: a
    step of one row reads the same weights as a step of two, and torch.compile would compile (and
    the runner capture) a step of its own for size one, which it specialises."""
    sizes, n = [], 2 if max_batch > 1 else 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch]


def dummy_rows(scratch_slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` padding rows: token 0 at position 0 of the scratch slot, greedy, sharing no prompt."""
    ints = torch.zeros(INT_ROWS, n, dtype=torch.int64)
    ints[SLOTS] = scratch_slot
    ints[PROMPT_GROUPS] = -1
    floats = torch.zeros(FLOAT_ROWS, n, dtype=torch.float32)
    floats[1] = 1.0
    return ints, floats


def advance(ints: torch.Tensor, tokens: torch.Tensor, scratch_slot: int) -> None:
    """In place: the next step's inputs of the same rows (each row's sampled token at the next
    position); rows of the scratch slot stay at position 0."""
    ints[TOKENS].copy_(tokens)
    ints[POSITIONS].add_((ints[SLOTS] != scratch_slot).to(ints.dtype))


class DecodeRunner:
    """Runs ``step`` over the first ``batch`` rows of its buffers, eagerly or through graphs."""

    def __init__(self, step: StepFn, *, max_batch: int, scratch_slot: int, device: torch.device,
                 graphs: bool, pad: bool | None = None):
        """``pad``: run batches padded to their bucket (default: with graphs, which need it)."""
        self.step, self.device, self.scratch_slot, self.use_graphs = step, device, scratch_slot, graphs
        self.pad = graphs if pad is None else pad
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        pad_ints, pad_floats = dummy_rows(scratch_slot, n)
        self._pad_ints, self._pad_floats = pad_ints.to(device), pad_floats.to(device)
        self.ints, self.floats = self._pad_ints.clone(), self._pad_floats.clone()
        self.batch = 0  # rows holding requests
        self.graphs: dict[tuple[int, Mode], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, Mode], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run concurrently)

    def bucket(self, batch: int) -> int:
        """Rows a step over ``batch`` requests computes (padded up to a graph's size)."""
        return next(n for n in self.buckets if n >= batch) if self.pad else batch

    def load(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Rows from the host: ints [7,B], floats [2,B]."""
        batch = ints.shape[1]
        self.ints[:, :batch].copy_(ints)
        self.floats[:, :batch].copy_(floats)
        self._set_batch(batch)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (indices into the current batch, in order), on the device."""
        index = torch.tensor(list(rows), dtype=torch.int64)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        self.ints[:, :len(rows)] = self.ints[:, :self.batch].index_select(1, index)
        self.floats[:, :len(rows)] = self.floats[:, :self.batch].index_select(1, index)
        self._set_batch(len(rows))

    def _set_batch(self, batch: int) -> None:
        n = self.bucket(batch)  # padding rows up to the bucket: the dummy request
        self.ints[:, batch:n].copy_(self._pad_ints[:, batch:n])
        self.floats[:, batch:n].copy_(self._pad_floats[:, batch:n])
        self.batch = batch

    def run(self, mode: Mode) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over the loaded rows -> (tokens [B], logprobs [B]) on the device; the buffers
        then hold the next step's inputs."""
        batch, n = self.batch, self.bucket(self.batch)
        if not self.use_graphs:
            ints = self.ints[:, :n]
            tokens, logprobs = self.step(ints, self.floats[:, :n], mode)
            advance(ints, tokens, self.scratch_slot)
            return tokens[:batch], logprobs[:batch]
        self.capture(n, mode)
        self.graphs[(n, mode)].replay()
        tokens, logprobs = self.outputs[(n, mode)]
        return tokens[:batch], logprobs[:batch]

    def capture(self, n: int, mode: Mode) -> bool:
        """Capture the graph of bucket ``n`` and ``mode`` unless it exists (or graphs are off);
        True if it was captured. The loaded rows are kept."""
        if not self.use_graphs or (n, mode) in self.graphs:
            return False
        with self._rows_kept():
            self._capture(n, mode)
        return True

    def warm(self, n: int, mode: Mode) -> None:
        """Run the step of ``n`` rows and ``mode`` once on dummy rows (torch.compile, if used,
        compiles it), capturing nothing. The loaded rows are kept."""
        with self._rows_kept():
            self._dummy_steps(n, mode, 1)

    @contextlib.contextmanager
    def _rows_kept(self) -> Iterator[None]:
        live = self.ints.clone(), self.floats.clone()
        yield
        self.ints.copy_(live[0])
        self.floats.copy_(live[1])

    def _dummy_steps(self, n: int, mode: Mode, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Dummy rows only: they write the scratch slot, never a real request's cache. Returns the
        # buffers' first n rows, holding the dummy rows' next inputs.
        self.ints[:, :n].copy_(self._pad_ints[:, :n])
        self.floats[:, :n].copy_(self._pad_floats[:, :n])
        ints, floats = self.ints[:, :n], self.floats[:, :n]
        for _ in range(count):
            tokens, _ = self.step(ints, floats, mode)
            advance(ints, tokens, self.scratch_slot)
        return ints, floats

    def _capture(self, n: int, mode: Mode) -> None:
        # Warm up (and let torch.compile, if used, compile) off the capturing stream.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            ints, floats = self._dummy_steps(n, mode, 2)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the NCCL watchdog) do not break the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.step(ints, floats, mode)
            advance(ints, out[0], self.scratch_slot)
        self.pool = graph.pool()
        self.graphs[(n, mode)], self.outputs[(n, mode)] = graph, out
