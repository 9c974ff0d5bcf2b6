"""The decode step compiled in a helper process while the run sets up.

A run on a cold compile cache compiles its decode step's graphs (the layer, the step's start and
end, the sampler's pick) inside its first generate call: 7-10 s of the first iteration on an H100,
after a setup that compiled the training layers. One process cannot overlap the two: dynamo
compiles one frame at a time (a process-wide lock), and tracing holds the interpreter. A second
process can: ``python -m shardflow.engine.generate.precompile``, started and handed its jobs by
``precompile_launch``. It builds the model's shapes with zeroed weights (one layer per distinct
attention window, a KV cache of a few blocks), compiles the steps that the first generate call
will run (``GenerationEngine.step_batches``) and exits. Its graphs and kernels land in the compile
cache (inductor's graph cache, AOTAutograd's, Triton's), keyed by content, where the run's own
compilation of the same graphs finds them: the run still traces them, but lowers and builds
nothing.

The run waits until the helper has compiled the first steps before it builds its engine
(``precompile_launch.Helper.wait_ready``): graphs half built are not built twice. The helper goes on
with the steps of shrinking batches while the run decodes, and is stopped when the first generate
call ends (its device memory, 1-2 GB for its embedding and head, a layer and a few blocks, is then
free for training's; the first call's KV cache is that much smaller). A helper that fails, or
runs past its time, costs the wait and a warning; the run compiles what it did not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from shardflow.config.model import ModelConfig
from shardflow.engine.compile_cache import start_compile_workers, use_compile_cache
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.kv_cache import block_layout, bytes_per_position
from shardflow.models import compile_settings
from shardflow.models.transformer import build_model
from shardflow.parallel.sharding import RankShard

logger = logging.getLogger(__name__)

SERVE_SECONDS = 900.0  # the longest a helper waits for its jobs


@dataclass(frozen=True)
class Job:
    """The decode steps of one engine: its model's shard, settings, device and dtype, the rows of
    its first step, its sampling modes, whether its rows read shared prompts and whether its batch
    shrinks as rows finish (see ``GenerationEngine.step_batches``)."""

    cfg: ModelConfig
    shard: RankShard
    engine: EngineConfig
    device: str
    dtype: torch.dtype
    batch: int
    modes: tuple[str, ...]
    shared: bool
    varying: bool


def merged(jobs: Sequence[Job]) -> list[Job]:
    """``jobs``, those that differ only in their modes as one (an engine's sampled and greedy calls)."""
    out: list[Job] = []
    for job in jobs:
        for i, other in enumerate(out):
            if dataclasses.replace(other, modes=job.modes) == job:
                out[i] = dataclasses.replace(other, modes=tuple(dict.fromkeys(other.modes + job.modes)))
                break
        else:
            out.append(job)
    return out


def job_engine(job: Job) -> GenerationEngine:
    """An engine of the job's settings on its device, over the model's shapes with zeroed weights: a
    layer per attention window, a KV cache of few blocks."""
    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = dataclasses.replace(job.shard, layers=_layer_per_window(job.cfg, job.shard.layers))
    model = build_model(job.cfg, shard, None, device, job.dtype)
    with torch.no_grad():
        for p in model.parameters():  # uninitialised memory could hold NaNs; zeros sample valid tokens
            p.zero_()
    return GenerationEngine(model, dataclasses.replace(job.engine, kv_cache_bytes=_small_cache(job, shard)))


def compile_jobs(jobs: Sequence[Job], ready: Path | None = None) -> None:
    """Compile the jobs' decode steps: every job's first step, then (``ready`` created) the steps
    of their shrinking batches."""
    engines = [job_engine(job) for job in jobs]
    batches = [engine.step_batches(job.batch, varying=job.varying) for job, engine in zip(jobs, engines)]
    for stage in ("first", "later"):
        for job, engine, sizes in zip(jobs, engines, batches):
            started, now = time.perf_counter(), sizes[:1] if stage == "first" else sizes[1:]
            if not now:
                continue
            for n in now:
                engine.compile_step(n, job.modes, shared=job.shared)
            logger.info(f"compiled the {stage} decode steps of a {job.cfg.num_layers}-layer, {job.cfg.hidden_size}-"
                        f"wide model (batches {now}, modes {list(job.modes)}) in {time.perf_counter() - started:.1f} s")
        if stage == "first" and ready is not None:
            logger.info(f"ready: {ready}")
            ready.touch()


def _layer_per_window(cfg: ModelConfig, layers: Sequence[int]) -> tuple[int, ...]:
    """The first of ``layers`` with each attention window: the decode layer compiles once per window."""
    first: dict[int | None, int] = {}
    for i in layers:
        first.setdefault(cfg.sliding_windows[i], i)
    return tuple(sorted(first.values()))


def _small_cache(job: Job, shard: RankShard) -> int:
    """Bytes of a KV cache with the slots of the job's engine (every slot is a graph input's row)
    and, paged, the fewest blocks it takes. The cache's block count is a dynamic size of the
    compiled graphs: it must not equal the block size (dynamo would take them for one size)."""
    config, cfg = job.engine, job.cfg
    max_len = (config.max_seq_len or cfg.max_position_embeddings) - 1  # as ``GenerationEngine.reset_cache``
    positions, per_slot = block_layout(max_len, config.kv_block_size)
    per_block = bytes_per_position(shard, cfg, job.dtype) * positions
    if positions == max_len:  # contiguous: a block per slot, and the scratch slot
        return (config.max_batch_size + 2) * per_block
    blocks = per_slot + 1
    if blocks + 1 == positions:  # with the scratch block
        blocks += 1
    return (blocks + 1) * per_block


def _end_with_parent() -> None:
    """Exit when the process that started this one is gone (a run that crashed or was stopped)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="shardflow-precompile-parent").start()


def main(argv: Sequence[str]) -> int:
    """``JOBS``: load the compiler and the device, wait for that file to appear
    (``precompile_launch``), compile its jobs."""
    _end_with_parent()
    # The run's own work first: its setup compiles too, on the same cores (in one pair measured, its
    # setup took 6 s longer beside a helper of the same priority).
    os.nice(10)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = Path(argv[0])
    compile_settings.apply()  # the compiler and the device made ready while the run imports its libraries
    import torch._inductor.compile_fx  # noqa: F401 - what the first compilation imports
    if torch.cuda.is_available():
        torch.empty(1, device="cuda")  # the context, on the one rank's device
    waited = time.perf_counter()
    while not path.exists():
        if time.perf_counter() - waited > SERVE_SECONDS:
            return 0
        time.sleep(0.02)
    given = pickle.loads(path.read_bytes())
    path.unlink(missing_ok=True)
    path.with_suffix(".log").unlink(missing_ok=True)  # what it wrote while it waited (nothing went wrong)
    if not given["jobs"]:
        return 0
    log = os.open(given["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # from now on, the run's log
    os.dup2(log, 1)
    os.dup2(log, 2)
    use_compile_cache(given["compile_cache"])
    start_compile_workers()
    compile_jobs(given["jobs"], Path(given["ready"]))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Its work is on disk: no teardown (the compile workers' shutdown, CUDA's) for the run to wait on.
    os._exit(code)
