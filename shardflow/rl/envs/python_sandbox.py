"""The ``python`` tool: run a snippet in a fresh interpreter with time, memory and output limits
and no network.

The snippet runs in its own process (``python -I``, an empty working directory, a clean
environment) with limits on CPU time, address space, file size and processes; the wall-clock
limit kills its whole process group; its output is cut at ``max_output_bytes``. On Linux it runs
in new user and network namespaces (no network interface at all) when the kernel allows it;
otherwise the interpreter's socket module refuses to connect, which stops ordinary code but not
a determined one. This is a resource sandbox for a model's code, not a security boundary against
an adversary: run untrusted workloads in a container.
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000

# Run before the snippet: without a network namespace, refuse sockets at the interpreter level.
BOOTSTRAP = """
import socket, sys
if not {isolated}:
    def _refuse(*a, **k):
        raise OSError("network access is disabled in this sandbox")
    socket.socket.connect = socket.socket.connect_ex = socket.create_connection = _refuse
    socket.getaddrinfo = _refuse
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__"}})
"""


def _limits(memory_bytes: int, cpu_s: int, file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _namespaces_work() -> bool:
    """Whether this kernel lets an unprivileged process enter new user and network namespaces."""
    try:
        probe = subprocess.run([sys.executable, "-I", "-c", "pass"], preexec_fn=_unshare, timeout=10,
                               capture_output=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _unshare() -> None:
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")


_ISOLATED: bool | None = None


def python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 16384) -> str:
    """Run Python code and return what it prints (standard output, then standard error).

    Args:
        code: the program, e.g. "print(sum(range(10)))"
    """
    global _ISOLATED
    if not isinstance(code, str):
        raise TypeError(f"code must be text, got {type(code).__name__}")
    if _ISOLATED is None:
        _ISOLATED = sys.platform.startswith("linux") and _namespaces_work()
    isolated = _ISOLATED

    def setup() -> None:
        if isolated:
            _unshare()
        _limits(memory_mb << 20, max(1, int(timeout_s) + 1), max_output_bytes)

    with tempfile.TemporaryDirectory(prefix="tool-") as cwd:
        proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP.format(isolated=isolated)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, preexec_fn=setup,
                                start_new_session=True)
        try:
            proc.stdin.write(code.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output, cut, timed_out = _read_capped(proc, timeout_s, max_output_bytes)
        if cut or timed_out or proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = proc.wait()
    text = output.decode(errors="replace")
    if cut:
        text += f"\n[output cut at {max_output_bytes} bytes]"
    if timed_out:
        return text + f"\n[killed: the program ran longer than {timeout_s:g} s]"
    if status != 0 and not cut:
        return text + f"\n[exit code {status}]"
    return text


def _read_capped(proc: subprocess.Popen, timeout_s: float, cap: int) -> tuple[bytes, bool, bool]:
    """(output up to ``cap`` bytes, whether more came, whether the time ran out)."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), False, True
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return b"".join(chunks)[:cap], True, False
