"""Starting the helper process that compiles the decode step ahead (``engine.generate.precompile``).

The helper's own start (an interpreter, torch, the compiler: 10-13 s on a fresh machine) is as long
as the run's setup that it should overlap. So ``shardflow train`` starts one before it imports
anything heavy (``prestart``): it imports what compiling takes and waits for its jobs, which the run
hands it once its setup knows them (``start``), or none (it exits). A helper started only then, at
the run's setup, came 10 s late on an H100 (the run waited longer for it than it would have taken
to compile): ranks in processes of their own, which have no helper waiting, compile for themselves.

Standard library only: the command line imports this before torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

HELPER = "shardflow.engine.generate.precompile"
WAIT_SECONDS = 600.0  # the longest a run waits for its helper before stopping it


class Helper:
    """A helper process at work on its jobs: first every job's first decode step (then it creates
    ``ready``), then the steps of shrinking batches."""

    def __init__(self, process: subprocess.Popen, log: Path):
        self.process, self.log, self.ready = process, log, log.with_suffix(".ready")
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = WAIT_SECONDS) -> float:
        """Wait until the helper has compiled the first decode steps (or ended), at most ``timeout``
        seconds (then stop it). Returns the seconds waited."""
        waited = time.perf_counter()
        while not self.ready.exists() and self.process.poll() is None:
            if time.perf_counter() - waited > timeout:
                self.stop()
                logger.warning(f"compiling the decode step ahead ran past {timeout:.0f} s and was stopped (it "
                               f"compiles at first use); its log: {self.log}")
                break
            time.sleep(0.01)
        if self.ready.exists():
            logger.info(f"the first decode steps compiled ahead in a helper process, "
                        f"{time.perf_counter() - self.started:.1f} s after its jobs")
        return time.perf_counter() - waited

    def finish(self) -> None:
        """Stop the helper if it still works (what it has not compiled compiles at first use); a
        failure is a warning."""
        code = self.process.poll()
        self.stop()
        self.ready.unlink(missing_ok=True)
        if code is None:
            logger.debug("the precompile helper stopped before its last steps (they compile at first use)")
        elif code != 0:
            logger.warning(f"compiling the decode step ahead failed (exit code {code}; it compiles at first "
                           f"use); its log: {self.log}")

    def stop(self) -> None:
        """End the helper if it still runs."""
        _stop(self.process)


_waiting: tuple[subprocess.Popen, Path] | None = None  # a helper waiting for its jobs, and their file


def prestart(*, force: bool = False) -> bool:
    """Start a helper that waits for its jobs, where an NVIDIA GPU is visible to this process
    (``force``: anywhere) and no launcher made it one rank of several; True if started."""
    global _waiting
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = os.path.exists("/proc/driver/nvidia/version") and visible not in ("", "-1")
    if _waiting is not None or not (force or (gpu and int(os.environ.get("WORLD_SIZE", "1")) == 1)):
        return False
    fd, name = tempfile.mkstemp(prefix="shardflow-precompile-", suffix=".jobs")
    os.close(fd)
    os.unlink(name)  # its appearance is the signal
    jobs = Path(name)
    with open(jobs.with_suffix(".log"), "w") as out:  # until it has jobs (then the run's log)
        process = subprocess.Popen([sys.executable, "-m", HELPER, str(jobs)], stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_helper_env(),
                                   start_new_session=True)
    atexit.register(_stop, process)
    _waiting = (process, jobs)
    return True


def start(jobs: Sequence[Any], compile_cache: str, log: Path) -> Helper | None:
    """Hand ``jobs`` (``precompile.Job``s) to the waiting helper, to compile in turn into
    ``compile_cache`` (``run.compile_cache``: the caller's cache, already in use), its output to
    ``log``; None where no helper waits (an empty list sends it away)."""
    global _waiting
    if not jobs:
        release()
        return None
    waiting, _waiting = _waiting, None
    if waiting is None:
        return None
    if waiting[0].poll() is not None:
        logger.warning(f"the precompile helper ended before its jobs came (exit code {waiting[0].returncode}; the "
                       f"decode step compiles at first use); its log: {waiting[1].with_suffix('.log')}")
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    log.with_suffix(".ready").unlink(missing_ok=True)  # an earlier run's, in the same directory
    _hand_over(waiting[1], jobs, compile_cache, log)
    return Helper(waiting[0], log)


def release() -> None:
    """Send a waiting helper away (no jobs for it: this process runs no rank that compiles)."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None and waiting[0].poll() is None:
        _hand_over(waiting[1], [], "", Path(os.devnull))


def _hand_over(path: Path, jobs: Sequence[Any], compile_cache: str, log: Path) -> None:
    """Write the jobs whole, then let them appear under ``path`` (a waiting helper reads no half)."""
    part = path.with_suffix(".part")
    given = {"jobs": list(jobs), "compile_cache": compile_cache, "log": str(log),
             "ready": str(log.with_suffix(".ready"))}
    part.write_bytes(pickle.dumps(given))
    os.replace(part, path)


def _helper_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # where this process found shardflow
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # Its Triton builds run beside the run's own compilation: half the cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, min(32, cores) // 2)))
    return env


def _stop(process: subprocess.Popen) -> None:
    """End the helper and its compile workers (its own process group), if it still runs."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # no group of its own (or gone): the process alone
            process.send_signal(sig)
        try:
            process.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue
