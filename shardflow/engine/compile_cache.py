"""Compiled code that outlives the process: a run's first iteration reuses what an earlier run compiled.

torch.compile's graphs (inductor's FX graph cache, AOTAutograd's forward and backward graphs),
triton's kernels and FlashAttention-4's are cached on disk by content. By default they sit under the
temporary directory, which machines clear; ``use_compile_cache`` moves them to a directory of the run's
choosing (``run.compile_cache``) and turns both graph caches on. Variables already set in the
environment win, so a cluster's shared cache stays in charge, except inductor's at torch's own default
(the temporary directory): importing torch's compiler writes that default into the environment.

Torch's compiler (dynamo, inductor: seconds to import) is imported here only when a run compiles;
processes that never compile (CPU ranks, tools) do not load it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from shardflow.models.transformer import TRIAL_TOKENS

logger = logging.getLogger(__name__)


def use_compile_cache(directory: str) -> Path | None:
    """Cache compiled graphs and kernels under ``directory`` (``~`` expanded; empty: torch's own
    defaults). Returns the directory used, or None."""
    if not directory:
        return None
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.runtime import cache_dir_utils

    root = Path(directory).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"run.compile_cache: cannot create {root}: {e}") from e
    default = getattr(cache_dir_utils, "default_cache_dir", None)  # private: a torch may lack it
    if default is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == os.path.abspath(default()):
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]  # torch's default, written by an import: not a choice
    # Inductor's graph cache keys dynamic sizes by name, not by the sizes its kernels were tuned for (the
    # layers' trial, ``TRIAL_TOKENS``): graphs compiled for another trial size must not be found.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / f"inductor-trial{TRIAL_TOKENS}"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    # FlashAttention-4's compiled kernels (the fa4 packed attention), read when it is first imported
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(root / "flash_attn_cute"))
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return root


def start_compile_workers() -> bool:
    """Start inductor's compile workers now, in the background; False where this torch or its
    settings compile in the calling process."""
    from torch._inductor.async_compile import AsyncCompile

    warm = getattr(AsyncCompile, "warm_pool", None)  # private: a torch may lack them
    ready = getattr(AsyncCompile, "use_process_pool", None)
    if warm is None or ready is None:
        return False
    warm()
    ready()  # its first call submits the job that tells when the workers are up
    return True


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's frames and the backward graphs
    AOTAutograd compiles), by torch's own timers; 0.0 where this torch keeps none, or where nothing
    has loaded the compiler (nothing compiled)."""
    timers = sys.modules.get("torch._dynamo.utils")
    spent = getattr(timers, "calculate_time_spent", None)  # private: a torch may lack it
    return float(spent().get("total_wall_time", 0.0)) if spent is not None else 0.0


def graph_cache_counts() -> tuple[int, int]:
    """Inductor's graph cache hits and misses in this process so far, by torch's own counters; (0, 0)
    where this torch keeps none, or where nothing has loaded the compiler."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)  # private: a torch may lack it
    inductor = counters.get("inductor", {}) if isinstance(counters, dict) else {}
    return int(inductor.get("fxgraph_cache_hit", 0)), int(inductor.get("fxgraph_cache_miss", 0))


_kernel_seconds: dict[int, float] = {}  # shardflow's own Triton kernels compiled, seconds by thread


def kernel_compile_seconds() -> float:
    """Seconds the calling thread has spent compiling shardflow's own Triton kernels (decode
    attention, the sampler, the head's statistics, gradient accumulation) at their first launch
    with each specialisation, by Triton's compilation listener; cache hits cost nothing here, and
    compilations ahead of time on other threads (``compile_ahead``) are theirs. Not in
    ``compile_seconds`` (dynamo does not see them), and not inductor's kernels (those are). Listens
    from its first call on (again if another listener took its place, which it then calls too);
    0.0 where Triton is not loaded or has no listener."""
    triton = sys.modules.get("triton")
    knobs = getattr(getattr(triton, "knobs", None), "compilation", None)
    if knobs is not None and hasattr(knobs, "listener") and not getattr(knobs.listener, "_shardflow", False):
        knobs.listener = _counting_listener(knobs.listener)
    return _kernel_seconds.get(threading.get_ident(), 0.0)


def _counting_listener(before):
    def listen(*, src, metadata, metadata_group, times, cache_hit):
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        module = getattr(getattr(getattr(src, "fn", None), "fn", None), "__module__", "") or ""
        if not cache_hit and module.startswith("shardflow."):
            thread = threading.get_ident()
            _kernel_seconds[thread] = _kernel_seconds.get(thread, 0.0) + times.total / 1e6  # Triton's microseconds

    listen._shardflow = True
    return listen


def compile_ahead(device: torch.device, what: str, compile_fn: Callable[[], object]) -> Future:
    """Run ``compile_fn`` (Triton warm-ups of shardflow's kernels: compilation without launches)
    on the process's one compile-ahead thread (jobs in turn, never two Triton compilations of
    ours at once), ``device`` its current CUDA device, while the caller goes on (loading, tracing:
    the host's threads mostly wait there). A kernel it has compiled costs its first launch nothing
    more; one it has not (another specialisation) compiles there, as it would have. A failure is
    logged as ``what`` and raises nothing: the launches compile what it did not."""
    def run() -> None:
        started = time.perf_counter()
        try:
            torch.cuda.set_device(device)  # a new thread's current device is the first one
            compile_fn()
        except Exception as e:  # noqa: BLE001 - the launches compile what this did not
            logger.warning(f"compiling {what} ahead failed (they compile at first use): {type(e).__name__}: {e}")
            return
        logger.debug(f"{what} compiled ahead in {time.perf_counter() - started:.1f} s")

    global _ahead
    if _ahead is None:
        _ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardflow-compile-ahead")
    return _ahead.submit(run)


_ahead: ThreadPoolExecutor | None = None
