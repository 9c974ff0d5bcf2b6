"""AdamW over flat float32 master weights, and the learning-rate schedule.

The model may compute in bf16; the optimizer keeps a float32 master copy of every local
parameter in one flat tensor (laid out like the gradient buffer), updates it with float32
gradients, and the engine copies it back into the model after each step. One flat tensor means
a handful of large elementwise kernels per step instead of several per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates
    eps: float = 1e-8  # added to the root of the second moment
    weight_decay: float = 0.0  # decoupled decay; applied to matrices only, not to norms or biases
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; None: no clipping
    schedule: str = "constant"  # constant | linear | cosine (decay after warmup)
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps to lr
    total_steps: int | None = None  # steps of the whole run; needed by linear and cosine
    min_lr_ratio: float = 0.0  # linear and cosine decay to lr * min_lr_ratio at total_steps

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer lr must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"optimizer eps must be positive, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer weight_decay must be non-negative, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule != "constant":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"lr schedule {self.schedule!r} needs total_steps greater than warmup_steps "
                    f"({self.warmup_steps}), got total_steps={self.total_steps}"
                )


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
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


class AdamW:
    """``torch.optim.AdamW``'s update, over one flat float32 tensor.

    ``decay`` lists views of ``master`` that get weight decay. The step count lives with the
    caller, which also drives the schedule, so that both always agree.
    """

    def __init__(self, master: torch.Tensor, decay: list[torch.Tensor], cfg: OptimConfig):
        assert master.dtype == torch.float32 and master.dim() == 1
        self.master, self.decay, self.cfg = master, decay, cfg
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float, step: int) -> None:
        """Apply update number ``step`` (1 for the first) with float32 ``grad`` shaped like master."""
        beta1, beta2 = self.cfg.betas
        if self.cfg.weight_decay and self.decay:
            torch._foreach_mul_(self.decay, 1.0 - lr * self.cfg.weight_decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias1 = 1.0 - beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
        denom = (self.exp_avg_sq.sqrt() / bias2_sqrt).add_(self.cfg.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
