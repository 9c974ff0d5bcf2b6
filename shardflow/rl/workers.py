"""A pool of worker processes for users' code: reward functions and environments run beside
decoding, each call bounded in time, every failure contained.

``call`` queues a task (a ``module:function`` and its arguments) on a channel (one per kind of
caller: environments, rewards) and returns at once; ``results`` collects what finished on a
channel. A background thread hands tasks to idle workers and enforces deadlines:
a task past its timeout, or whose worker dies, gets an error result, and the worker is killed and
started again, so a hung, crashing or runaway call never blocks the rank. A task may name a
``home`` worker: an episode's environment lives in one worker's memory, so its steps go there
(``home_for`` spreads episodes over the workers). Worker state is lost when a worker restarts;
``generation`` tells a caller that it happened.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from shardflow.rl.worker import read_frame, write_frame

WORKER_MODULE = "shardflow.rl.worker"


@dataclass
class Result:
    key: Any  # the caller's name for the task
    ok: bool
    value: Any  # the function's return value, or the error's text
    seconds: float  # in the worker (the timeout, for a task that ran out of time)


@dataclass
class _Task:
    channel: str
    key: Any
    spec: str
    args: tuple
    timeout_s: float
    home: int | None


class _Worker:
    def __init__(self, index: int):
        self.index, self.generation = index, 0
        self.proc: subprocess.Popen | None = None
        self.task: _Task | None = None
        self.deadline = 0.0
        self.started = 0.0
        self.homed: deque[_Task] = deque()
        self.episodes = 0  # episodes living here (``home_for``)

    def start(self) -> None:
        to_worker, task_in = os.pipe()  # parent writes task_in, worker reads to_worker
        from_worker, result_out = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(to_worker), str(result_out)],
                                     pass_fds=(to_worker, result_out), stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env, cwd=os.getcwd())
        os.close(to_worker)
        os.close(result_out)
        self.tasks_fd, self.results_fd = task_in, from_worker
        self.generation += 1

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own children too (a tool's subprocess)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for fd in (self.tasks_fd, self.results_fd):
            os.close(fd)
        self.proc = None


class WorkerPool:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.size = size
        self._workers = [_Worker(i) for i in range(size)]
        self._shared: deque[_Task] = deque()
        self._done: dict[str, queue.Queue[Result]] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._outstanding: dict[str, int] = {}
        self.restarts = 0
        self._closed = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # ----- the caller's side -------------------------------------------------------------------

    def call(self, channel: str, key: Any, spec: str, *args: Any, timeout_s: float, home: int | None = None) -> None:
        """Run ``spec(*args)`` in a worker (worker ``home`` if given), within ``timeout_s`` seconds;
        its result comes on ``channel``."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        task = _Task(channel, key, spec, args, timeout_s, home)
        with self._lock:
            (self._workers[home].homed if home is not None else self._shared).append(task)
            self._outstanding[channel] = self._outstanding.get(channel, 0) + 1
            self._done.setdefault(channel, queue.Queue())
        self._ensure_thread()
        os.write(self._wake_w, b"x")

    def start(self) -> None:
        """Start the workers now rather than at the first call, so that their start-up overlaps the
        caller's own work."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        self._ensure_thread()

    def results(self, channel: str, *, wait: bool = False, timeout: float | None = None) -> list[Result]:
        """The results of ``channel`` finished so far (with ``wait``: at least one, unless nothing
        is outstanding there or ``timeout`` seconds pass)."""
        with self._lock:
            done = self._done.setdefault(channel, queue.Queue())
        out = []
        if wait and self.outstanding(channel):
            try:
                out.append(done.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(done.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._outstanding[channel] = self._outstanding.get(channel, 0) - len(out)
        return out

    def outstanding(self, channel: str) -> int:
        """Tasks of ``channel`` queued or running, or finished but not collected."""
        with self._lock:
            return self._outstanding.get(channel, 0)

    def home_for(self) -> tuple[int, int]:
        """A worker for a new episode (the one holding fewest) and its current generation: an
        episode whose worker's generation changed has lost its state."""
        with self._lock:
            worker = min(self._workers, key=lambda w: w.episodes)
            worker.episodes += 1
            return worker.index, worker.generation

    def leave(self, home: int) -> None:
        """An episode of worker ``home`` is over."""
        with self._lock:
            self._workers[home].episodes -= 1

    def generation(self, home: int) -> int:
        with self._lock:
            return self._workers[home].generation

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=10)
        for w in self._workers:
            w.kill()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- the dispatching thread ----------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            for w in self._workers:  # generation 1 before any episode takes a home
                if w.proc is None:
                    w.start()
            self._thread = threading.Thread(target=self._loop, name="worker-pool", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        registered: dict[int, int] = {}  # results fd -> worker index
        while not self._closed:
            for w in self._workers:
                if w.proc is not None and w.results_fd not in registered:
                    selector.register(w.results_fd, selectors.EVENT_READ, w.index)
                    registered[w.results_fd] = w.index
            self._dispatch()
            now = time.monotonic()
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            wait = max(0.0, min(deadlines) - now) if deadlines else 1.0
            for event, _ in selector.select(timeout=wait):
                if event.data is None:
                    os.read(self._wake_r, 1 << 16)
                    continue
                w = self._workers[event.data]
                self._receive(w, selector, registered)
            now = time.monotonic()
            for w in self._workers:
                if w.task is not None and now >= w.deadline:
                    task = w.task
                    self._restart(w, selector, registered)
                    self._finish(task, False, f"TimeoutError: took longer than {task.timeout_s:g} s", task.timeout_s)
        selector.close()

    def _dispatch(self) -> None:
        with self._lock:
            for w in self._workers:
                if w.task is not None or w.proc is None:
                    continue
                task = w.homed.popleft() if w.homed else (self._shared.popleft() if self._shared else None)
                if task is None:
                    continue
                try:
                    payload = pickle.dumps((next(self._ids), task.spec, task.args))
                except Exception as e:  # noqa: BLE001 - arguments that cannot travel are the task's error
                    self._finish(task, False, f"the task's arguments cannot be sent: {e}", 0.0)
                    continue
                w.task, w.started, w.deadline = task, time.monotonic(), time.monotonic() + task.timeout_s
                write_frame(w.tasks_fd, payload)

    def _receive(self, w: _Worker, selector, registered: dict[int, int]) -> None:
        try:
            frame = read_frame(w.results_fd)
            answer = pickle.loads(frame) if frame is not None else None
        except Exception as e:  # noqa: BLE001 - an unreadable answer fails its task, never this thread
            frame, problem = None, f"{type(e).__name__}: {e}"
        else:
            problem = ""
        task = w.task
        if frame is None:  # the worker died (or sent nonsense): its task failed
            try:
                code = w.proc.wait(timeout=1) if w.proc is not None else None
            except subprocess.TimeoutExpired:
                code = None
            self._restart(w, selector, registered)
            if task is not None:
                why = problem or f"the worker process exited (code {code})"
                self._finish(task, False, f"WorkerDied: {why}", time.monotonic() - w.started)
            return
        _, ok, value, seconds = answer
        w.task = None
        if task is not None:
            self._finish(task, ok, value, seconds)

    def _finish(self, task: _Task, ok: bool, value: Any, seconds: float) -> None:
        self._done[task.channel].put(Result(task.key, ok, value, seconds))

    def _restart(self, w: _Worker, selector, registered: dict[int, int]) -> None:
        if w.proc is not None and w.results_fd in registered:
            selector.unregister(w.results_fd)
            del registered[w.results_fd]
        w.kill()
        w.task = None
        self.restarts += 1
        if not self._closed:
            w.start()
