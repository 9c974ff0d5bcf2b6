"""A Triton kernel's launch, compiled and loaded without running: what a warm-up on a background
thread does so that the kernel's first launch costs nothing more.

Triton's ``warmup`` compiles a kernel; its launcher (a small C extension per argument signature,
built with the host's compiler) and the module's load onto the device wait for the first launch
(0.2-0.7 s a kernel on a fresh machine, seen inside a run's first decode step). ``warmup`` here
does both at once, on the calling thread's current device.
"""

from __future__ import annotations

from typing import Any, Callable


def warmup(kernel: Any, grid: Any) -> Callable[..., Any]:
    """A callable like ``kernel[grid]`` that compiles the kernel for its arguments and loads it
    instead of launching it; returns Triton's compiled kernel."""
    def run(*args, **options):
        compiled = kernel.warmup(*args, grid=grid, **options)
        load = getattr(compiled, "_init_handles", None)  # Triton's own first-launch step (builds the launcher)
        if load is not None:
            load()
        return compiled

    return run
