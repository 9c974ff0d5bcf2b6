"""A long-lived pool of gloo ranks shared by the multi-rank tests.

Starting a process that imports torch costs seconds, so the test session starts the ranks once
and sends them jobs. A job is a module-level function ``fn(world, *args)`` run on every rank
(SPMD, like the real runtime); ranks outside a job's layout simply return. If any rank fails,
the pool collects the tracebacks, restarts (the others may be stuck in a collective) and raises.
"""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from shardflow.parallel.launch import free_port

JOB_TIMEOUT_S = float(os.environ.get("SHARDFLOW_TEST_JOB_TIMEOUT", "300"))


def _worker(rank: int, size: int, init_method: str, tasks, results) -> None:
    os.environ.setdefault("SHARDFLOW_COMM_TIMEOUT", "120")
    import torch

    from shardflow.parallel.world import init_world

    torch.set_num_threads(1)
    world = init_world(rank, size, init_method, "gloo")
    while True:
        job = tasks.get()
        if job is None:
            return
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(world, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self, size: int):
        self.size = size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.SimpleQueue() for _ in range(self.size)]
        self._results = ctx.Queue()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.size, init_method, self._tasks[r], self._results), daemon=True)
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(world, *args, **kwargs)`` on every rank; returns the results by rank."""
        for t in self._tasks:
            t.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = JOB_TIMEOUT_S
        while len(results) + len(failures) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=deadline)
            except queue.Empty:
                missing = sorted(set(range(self.size)) - set(results) - set(failures))
                failures.setdefault(-1, f"ranks {missing} did not finish within {deadline:.0f}s")
                break
            (results if ok else failures)[rank] = value
            if failures:
                deadline = 10.0  # the rest may be stuck waiting for the failed rank
        if failures:
            self.restart()
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RuntimeError(f"job {fn.__name__} failed:\n{text}")
        return [results[r] for r in range(self.size)]

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
