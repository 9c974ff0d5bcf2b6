"""Start the ranks of a job: spawn them on this machine, or join a torchrun launch.

Every rank runs the same ``entry(world, *args)`` (SPMD). When one rank raises, the others are
terminated and the job ends with that rank's traceback and a non-zero exit; nothing waits on a
dead peer.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from shardflow.parallel.failures import RankFailed
from shardflow.parallel.logs import current_level, setup_logging
from shardflow.parallel.world import init_world

Entry = Callable[..., Any]
FAILURE_GRACE_S = 3.0  # after a rank fails, how long the others get to report their own errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch(entry: Entry, nprocs: int, *args: Any, backend: str | None = None,
           log_dir: str | Path | None = None) -> Any:
    """Run ``entry(world, *args)`` on every rank, each logging at this process's level (and to
    ``log_dir``, see ``parallel.logs``).

    Under torchrun this process is one rank of the existing job (``nprocs`` must match its
    world size) and the entry's result is returned. A job of one rank runs in this process (no
    second interpreter to start and import everything into again: seconds of every run's start)
    and its result is returned. Otherwise ``nprocs`` ranks are spawned and rank 0's result is not
    returned (each rank reports for itself).
    """
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        setup_logging(current_level(), rank=int(os.environ["RANK"]), log_dir=log_dir)
        if size != nprocs:
            raise ValueError(f"the job needs {nprocs} ranks but torchrun started {size}")
        world = init_world(int(os.environ["RANK"]), size, "env://", backend,
                           local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        result = entry(world, *args)  # on an error torchrun ends the other ranks
        _teardown()
        return result
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        if torch.cuda.device_count() < nprocs:
            raise ValueError(f"the job needs {nprocs} GPUs but this machine has {torch.cuda.device_count()}")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    if nprocs == 1:
        return _in_process(entry, init_method, backend, args, log_dir)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(rank, entry, nprocs, init_method, backend, args, errors,
                                                         current_level(), log_dir),
                         daemon=False) for rank in range(nprocs)]
    for p in procs:
        p.start()
    try:
        failure = _watch(procs, errors)
    finally:
        _stop(procs)
    if failure is not None:
        raise RankFailed(failure)
    return None


def _watch(procs, errors) -> str | None:
    """Wait for every rank; on the first failure, give the others a moment to report theirs and
    return a message naming the rank that caused it, and the others as what followed. A rank that
    raises reports its traceback before it exits, so one that died without a report (killed, or
    crashed) came first: its peers fail after it, with errors such as "Connection reset by peer".
    Otherwise the earliest report is the cause."""
    events: dict[int, tuple[float, str]] = {}  # rank -> (when, what): its report, or its death without one
    deadline = None
    while True:
        while not errors.empty():
            when, rank, text = errors.get()
            events[rank] = min(events.get(rank, (when, text)), (when, text))
        exits = [p.exitcode for p in procs]
        if all(code == 0 for code in exits):
            return None
        now = time.time()
        for rank, code in enumerate(exits):
            if code not in (None, 0) and rank not in events:
                events[rank] = (now, _death(code))  # no report (yet): killed, or it died reporting
        if events and deadline is None:
            deadline = time.monotonic() + FAILURE_GRACE_S
        if deadline is not None and (time.monotonic() > deadline or all(code is not None for code in exits)):
            while not errors.empty():  # a report beats the death it explains
                when, rank, text = errors.get()
                if rank not in events or events[rank][1].startswith("died"):
                    events[rank] = (min(when, events.get(rank, (when, ""))[0]), text)
            return _failure_message(events)
        mp_connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)


def _death(code: int) -> str:
    if code < 0:
        try:
            return f"died from signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"died from signal {-code} (exit code {code})"
    return f"died with exit code {code}"


def _failure_message(events: dict[int, tuple[float, str]]) -> str:
    order = sorted(events, key=lambda r: (not events[r][1].startswith("died"), events[r][0], r))
    first, text = order[0], events[order[0]][1]
    head = f"rank {first} {text}" if text.startswith("died") else f"rank {first} failed:\n{text}"
    rest = [f"rank {r}: " + (events[r][1] if events[r][1].startswith("died")
                             else events[r][1].strip().splitlines()[-1]) for r in order[1:]]
    if rest:
        head += "\nthen, in the order they failed:\n" + "\n".join("  " + line for line in rest)
    return head


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank: int, entry: Entry, size: int, init_method: str, backend: str | None,
               args: tuple, errors, log_level: int, log_dir: str | Path | None) -> None:
    try:
        # Progress bars lock within the process: tqdm's default lock is a semaphore, which a rank
        # ended by os._exit or terminate() would leave behind for the resource tracker to report.
        tqdm.set_lock(threading.RLock())
        setup_logging(log_level, rank=rank, log_dir=log_dir)
        world = init_world(rank, size, init_method, backend)
        if world.backend == "gloo":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        entry(world, *args)
    except BaseException:  # noqa: BLE001 - reported to the launcher, which ends the job
        errors.put((time.time(), rank, traceback.format_exc()))
        sys.stdout.flush()
        os._exit(1)  # skip teardown: peers may be gone, and destroying the group could hang
    finally:
        sys.stdout.flush()
    _teardown()


def _in_process(entry: Entry, init_method: str, backend: str | None, args: tuple,
                log_dir: str | Path | None) -> Any:
    """The one rank of a job, here; its failure reads as a spawned rank's would."""
    setup_logging(current_level(), rank=0, log_dir=log_dir)
    world = init_world(0, 1, init_method, backend)
    try:
        result = entry(world, *args)
    except Exception as e:  # noqa: BLE001 - the job's failure, with its traceback (Ctrl-C passes as it is)
        raise RankFailed(f"rank 0 failed:\n{traceback.format_exc()}") from e
    finally:
        _teardown()
    return result


def _teardown() -> None:
    """Wait until every rank is done before any closes its connections: a gloo rank whose peer
    tears down first can abort in a communication thread ("terminate called without an active
    exception", seen once at the end of a two-rank run)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
