"""The MLP's SwiGLU inside its products, through quack's CuTe DSL kernels where they are installed.

The plain MLP is three products with SwiGLU between them as elementwise kernels: forward reads
gate and up back to write silu(gate) * up, backward reads gate, up and the product's gradient to
write theirs (at copy bandwidth, 4-5% of a Qwen3 training step on Hopper). quack (the
``quack-kernels`` package) fuses them into the products: gate and up as one product whose
epilogue applies SwiGLU, and backward's down product whose epilogue applies its derivative. Same
math, float32 inside the epilogues; the weights stay as the checkpoint names them (gate and up are
concatenated per call, a copy of the two weights).

``kernel``: ``torch`` (the plain MLP), ``quack``, or ``auto`` (quack where it is installed and
runs: Hopper or Blackwell, bf16/fp16, no MLP bias, sizes that are multiples of 8).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Callable

import torch

KERNELS = ("auto", "torch", "quack")

# (x [..., H], gate weight [I, H], up weight [I, H], down weight [H, I]) -> [..., H]: the MLP
# before its tp all-reduce.
SwiGLU = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@lru_cache(maxsize=1)
def quack_available() -> bool:
    """Whether quack's MLP (``quack.mlp``, the ``quack-kernels`` package) can be imported."""
    try:
        return importlib.util.find_spec("quack.mlp") is not None
    except ModuleNotFoundError:
        return False


def quack_runs(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, bias: bool) -> bool:
    """Whether ``auto`` picks quack for an MLP of these sizes (``intermediate``: this rank's)."""
    if device.type != "cuda" or bias or dtype not in (torch.bfloat16, torch.float16) or not quack_available():
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10) and hidden % 8 == 0 and intermediate % 8 == 0


def check_kernel(kernel: str, setting: str = "MLP kernel") -> None:
    """A clear error, before any work, for a kernel that is unknown or whose package is missing
    (``setting``: what the message calls the choice)."""
    if kernel not in KERNELS:
        raise ValueError(f"{setting}: unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
    if kernel == "quack" and not quack_available():
        raise ValueError(f"{setting} 'quack' needs quack's kernels (pip install quack-kernels: the quack.mlp "
                         "module), which are not installed")


def swiglu_quack(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(x @ gate.T) * (x @ up.T)) through quack's fused products, forward and backward."""
    from quack.mlp import mlp_func  # optional dependency: only where quack_available()

    # concat_layout: the first product's weight is [gate; up] as stored, not interleaved rows
    return mlp_func(x, torch.cat((gate, up)), down, activation="swiglu", tuned=False, concat_layout=True)


def choose(kernel: str, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int,
           bias: bool) -> SwiGLU | None:
    """The fused SwiGLU that ``kernel`` asks for on this device and these sizes, or None (the
    plain MLP). ``quack`` where it cannot run is an error, named before any work."""
    check_kernel(kernel)
    runs = quack_runs(device, dtype, hidden, intermediate, bias)
    if kernel == "quack" and not runs:
        raise ValueError(f"MLP kernel 'quack' does not run here ({device}, {dtype}, hidden {hidden}, "
                         f"intermediate {intermediate}{', with bias' if bias else ''}): it needs a Hopper or "
                         "Blackwell GPU, bf16 or fp16, no MLP bias and sizes that are multiples of 8")
    return swiglu_quack if kernel in ("quack", "auto") and runs else None
