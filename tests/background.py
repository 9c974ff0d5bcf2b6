"""Subprocess checks run side by side.

The tests run one at a time, and a test that waits on one subprocess (Triton's interpreter, a
benchmark's CPU mode) leaves the machine's other cores idle. A module's fixture starts all of
its selected subprocess checks at once, at most ``WORKERS`` running together, and each test then
waits for its own result: the same checks, each still a test of its own.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

WORKERS = max(2, min(4, os.cpu_count() or 2))


class Background:
    def __init__(self, workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(workers)
        self._runs: dict[str, Future] = {}
        self.outs: dict[str, Path] = {}  # where a check writes its files, for its test to read

    def start(self, key: str, args: list[str], **kwargs) -> None:
        """Run ``args`` (``subprocess.run``'s keyword arguments too; output captured as text)."""
        if key in self._runs:
            raise ValueError(f"check {key!r} started twice")
        self._runs[key] = self._pool.submit(subprocess.run, args, capture_output=True, text=True, **kwargs)

    def result(self, key: str) -> subprocess.CompletedProcess:
        """The finished process of check ``key`` (waits for it)."""
        return self._runs[key].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected(request: pytest.FixtureRequest, test: str) -> list[pytest.Item]:
    """The session's items of ``test``, a test function of the requesting module (one per
    parameter set; none when it is not selected)."""
    return [item for item in request.session.items
            if item.module is request.module and getattr(item, "originalname", None) == test]
