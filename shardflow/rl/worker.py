"""The worker process of ``rl.workers.WorkerPool``: runs users' functions, one task at a time.

Started as ``python -m shardflow.rl.worker IN OUT`` with two pipe descriptors. A task is a
length-prefixed pickle ``(task id, "module:function", args)``; the answer ``(task id, ok, value or
error text, seconds)``. Importing this module loads no torch, so a worker starts in a fraction of
a second. Its standard output is discarded (a user's prints cannot flood the run's logs); the
worker dies with the rank that started it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
import time
from typing import Any

from shardflow.rl.user_code import load_object

HEADER = struct.Struct("<Q")
MAX_FRAME = 64 << 20  # a larger answer is an error, not a stalled pipe
PR_SET_PDEATHSIG = 1


def write_frame(fd: int, payload: bytes) -> None:
    data = HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> bytes | None:
    """One frame, or None at the end of the stream."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes is more than the {MAX_FRAME} allowed")
    return _read_exactly(fd, size)


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the closed task pipe still ends an idle worker
            pass


def run_task(spec: str, args: tuple) -> Any:
    return load_object(spec, "worker function")(*args)


def main(fd_in: int, fd_out: int) -> None:
    _die_with_parent()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    while True:
        frame = read_frame(fd_in)
        if frame is None:
            return
        task_id, spec, args = pickle.loads(frame)
        start = time.perf_counter()
        try:
            value, ok = run_task(spec, args), True
        except BaseException as e:  # noqa: BLE001 - the pool reports it; the worker goes on
            value, ok = f"{type(e).__name__}: {e}"[:2000], False
        seconds = time.perf_counter() - start
        try:
            payload = pickle.dumps((task_id, ok, value, seconds))
        except Exception as e:  # noqa: BLE001 - an answer that cannot travel is the task's error
            payload = pickle.dumps((task_id, False, f"the result cannot be sent back: {type(e).__name__}: {e}",
                                    seconds))
        if len(payload) > MAX_FRAME:
            payload = pickle.dumps((task_id, False, f"the result is {len(payload)} bytes, more than {MAX_FRAME}",
                                    seconds))
        write_frame(fd_out, payload)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
