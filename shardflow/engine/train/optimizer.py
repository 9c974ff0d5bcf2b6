"""AdamW over flat float32 master weights, and the learning-rate schedule.

The model may compute in bf16; the optimizer keeps a float32 master copy of every local
parameter in one flat tensor (laid out like the gradient buffer), updates it with float32
gradients, and the engine copies it back into the model after each step. The update is torch's
fused AdamW kernel over views of the flat tensors (one group with weight decay, one without):
one read and write of each state tensor a step. The state can live in host memory instead,
streamed through the device in chunks (``offload``). The settings are the run's own
(``config.experiment.OptimConfig``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from shardflow.config.experiment import OptimConfig


def check_schedule(cfg: OptimConfig) -> None:
    """A decaying schedule needs to know where it ends: more steps than the warm-up."""
    if cfg.schedule != "constant" and cfg.total_steps <= cfg.warmup_steps:
        raise ValueError(f"lr schedule {cfg.schedule!r} needs total_steps greater than warmup_steps "
                         f"({cfg.warmup_steps}), got total_steps={cfg.total_steps}")


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1 for the first).

    Warmup: ``lr * step / warmup_steps`` for the first ``warmup_steps`` steps. Then constant, or a
    linear / cosine decay whose progress ``(step - warmup) / (total - warmup)`` reaches 1 (and the
    rate ``lr * min_lr_ratio``) at ``total_steps``; later steps keep that rate.
    """
    if step < 1:
        raise ValueError(f"optimizer steps count from 1, got {step}")
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    check_schedule(cfg)
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


# What the model does with updated master weights: ``updated(lo, hi, values)`` for the part of the
# optimizer's flat layout [lo, hi) (values on the training device).
Updated = Callable[[int, int, torch.Tensor], None]

DEFAULT_CHUNK_NUMEL = 1 << 24  # 64 MiB per float32 tensor of an offloaded step's chunk


def adamw_update(tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 spans: list[tuple[int, int, bool]], cfg: OptimConfig, lr: float, step: torch.Tensor) -> None:
    """``torch.optim.AdamW``'s update (its fused kernel: one read and write of each state tensor,
    no temporaries) of flat float32 (master, exp_avg, exp_avg_sq, grad), in place, over ``spans``
    [lo, hi) of them, weight decay where their flag says; ``step``: the update's number, a float32
    tensor on their device."""
    for decayed in (True, False):
        master, exp_avg, exp_avg_sq, grad = ([t[lo:hi] for lo, hi, decay in spans if decay == decayed]
                                             for t in tensors)
        if master:
            torch._fused_adamw_(master, grad, exp_avg, exp_avg_sq, [], [step] * len(master), lr=lr,
                                beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay if decayed else 0.0,
                                eps=cfg.eps, amsgrad=False, maximize=False)


class AdamW:
    """``torch.optim.AdamW``'s update, over one flat float32 tensor.

    ``decay`` lists the spans ``[lo, hi)`` of ``master`` that get weight decay. The step count
    lives with the caller, which also drives the schedule, so that both always agree.

    On the device a step is one pass of the fused kernel over the whole state. ``offload``: the
    master weights and both moments live in host memory (pinned where the device is a GPU) and a
    step streams them through the device in chunks of ``chunk_numel`` elements: while one chunk is
    updated, the next is copied in and the previous one copied out, on two copy streams. The device
    holds two chunks of the three tensors, whatever the model's size.
    """

    def __init__(self, master: torch.Tensor, decay: list[tuple[int, int]], cfg: OptimConfig, *,
                 offload: bool = False, device: torch.device | None = None,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL):
        assert master.dtype == torch.float32 and master.dim() == 1
        check_schedule(cfg)
        self.device, self.cfg, self.offload = device or master.device, cfg, offload
        self.spans = _spans(sorted(decay), master.numel())
        if offload:
            pin = self.device.type == "cuda"
            if master.device.type != "cpu" or (pin and not master.is_pinned()):
                master = master.to("cpu").pin_memory() if pin else master.to("cpu")
            self.exp_avg, self.exp_avg_sq = (torch.zeros(master.numel(), pin_memory=pin) for _ in range(2))
            self._buffers: list[list[torch.Tensor]] = []
        else:
            self.exp_avg = torch.zeros_like(master)
            self.exp_avg_sq = torch.zeros_like(master)
        self.chunk_numel = min(chunk_numel, max(1, master.numel()))
        self.master = master
        self._step = torch.zeros((), dtype=torch.float32, device=self.device)  # the fused kernel reads it there

    def _chunk_spans(self, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """``spans`` within elements [lo, hi) of the layout, relative to ``lo``."""
        return [(max(a, lo) - lo, min(b, hi) - lo, d) for a, b, d in self.spans if max(a, lo) < min(b, hi)]

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float, step: int, updated: Updated) -> None:
        """Apply update number ``step`` (1 for the first) with float32 ``grad`` (on the device, shaped
        like master), then hand the new master weights to ``updated``."""
        self._step.fill_(step)
        if not self.offload:
            adamw_update((self.master, self.exp_avg, self.exp_avg_sq, grad), self.spans, self.cfg, lr, self._step)
            updated(0, self.master.numel(), self.master)
            return
        host = (self.master, self.exp_avg, self.exp_avg_sq)
        n, size = self.master.numel(), self.chunk_numel
        if not self._buffers:
            self._buffers = [[torch.empty(size, device=self.device) for _ in host] for _ in range(2)]
        streams = _CopyStreams(self.device)
        for i, lo in enumerate(range(0, n, size)):
            hi, k = min(lo + size, n), i % 2
            chunk = [b[:hi - lo] for b in self._buffers[k]]
            with streams.copy_in(k):
                for b, h in zip(chunk, host):
                    b.copy_(h[lo:hi], non_blocking=True)
            streams.compute(k)
            adamw_update((*chunk, grad[lo:hi]), self._chunk_spans(lo, hi), self.cfg, lr, self._step)
            updated(lo, hi, chunk[0])
            with streams.copy_out(k):
                for b, h in zip(chunk, host):
                    h[lo:hi].copy_(b, non_blocking=True)
        streams.finish()


def _spans(decay: list[tuple[int, int]], n: int) -> list[tuple[int, int, bool]]:
    """[0, n) as (lo, hi, decayed) spans: the sorted, disjoint ``decay`` spans and the gaps between them."""
    spans, at = [], 0
    for lo, hi in decay:
        if lo > at:
            spans.append((at, lo, False))
        if hi > lo:
            spans.append((lo, hi, True))
        at = max(at, hi)
    if at < n:
        spans.append((at, n, False))
    return spans


class _CopyStreams:
    """The ordering of an offloaded step on a GPU: buffer k's copy in waits until its last copy out
    is done, its update waits for its copy in, its copy out for its update. Elsewhere every copy
    is synchronous and this does nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if not self.cuda:
            return
        self.main = torch.cuda.current_stream(device)
        self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
        # the previous step's copies and this step's gradient come before anything here
        self.h2d.wait_stream(self.main)
        self.d2h.wait_stream(self.main)
        self.loaded = [torch.cuda.Event() for _ in range(2)]
        self.freed: list[torch.cuda.Event | None] = [None, None]

    @contextlib.contextmanager
    def copy_in(self, k: int):
        if not self.cuda:
            yield
            return
        if self.freed[k] is not None:
            self.h2d.wait_event(self.freed[k])
        with torch.cuda.stream(self.h2d):
            yield
        self.loaded[k].record(self.h2d)

    def compute(self, k: int) -> None:
        if self.cuda:
            self.main.wait_event(self.loaded[k])

    @contextlib.contextmanager
    def copy_out(self, k: int):
        if not self.cuda:
            yield
            return
        self.d2h.wait_stream(self.main)
        with torch.cuda.stream(self.d2h):
            yield
        self.freed[k] = torch.cuda.Event()
        self.freed[k].record(self.d2h)

    def finish(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.d2h)
            self.main.wait_stream(self.h2d)
