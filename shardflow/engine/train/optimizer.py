"""AdamW over flat float32 master weights, and the learning-rate schedule.

The model may compute in bf16; the optimizer keeps a float32 master copy of every local
parameter in one flat tensor (laid out like the gradient buffer), updates it with float32
gradients, and the engine copies it back into the model after each step. One flat tensor means
a handful of large elementwise kernels per step instead of several per parameter. The settings
are the run's own (``config.experiment.OptimConfig``).
"""

from __future__ import annotations

import math

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


class AdamW:
    """``torch.optim.AdamW``'s update, over one flat float32 tensor.

    ``decay`` lists views of ``master`` that get weight decay. The step count lives with the
    caller, which also drives the schedule, so that both always agree.
    """

    def __init__(self, master: torch.Tensor, decay: list[torch.Tensor], cfg: OptimConfig):
        assert master.dtype == torch.float32 and master.dim() == 1
        check_schedule(cfg)
        self.master, self.decay, self.cfg = master, decay, cfg
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float, step: int) -> None:
        """Apply update number ``step`` (1 for the first) with float32 ``grad`` shaped like master."""
        beta1, beta2 = self.cfg.beta1, self.cfg.beta2
        if self.cfg.weight_decay and self.decay:
            torch._foreach_mul_(self.decay, 1.0 - lr * self.cfg.weight_decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias1 = 1.0 - beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
        denom = (self.exp_avg_sq.sqrt() / bias2_sqrt).add_(self.cfg.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)
