"""Logging of a job: what every module says through ``logging.getLogger(__name__)``.

The console shows rank 0 only: information on stdout (written around any progress bar, so that
bars and lines do not garble each other), warnings and errors on stderr. With a run directory,
every rank also writes everything it logs, with times, to ``logs/rank-NNNNN.log`` there, so that
a problem on one rank can be read after the run. The level (``shardflow --log-level``) applies to
both and reaches the spawned ranks through the launcher.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = "shardflow"
FILE_FORMAT = "%(asctime)s rank %(rank)s %(levelname)s %(name)s: %(message)s"


class _Console(logging.Handler):
    """Information to stdout through ``tqdm.write``; warnings and errors to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.WARNING:
                print(text, file=sys.stderr, flush=True)
            else:
                tqdm.write(text, file=sys.stdout)
        except Exception:  # noqa: BLE001 - logging must never take the job down
            self.handleError(record)


class _Rank(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(level: int | str = logging.INFO, *, rank: int = 0, log_dir: str | Path | None = None) -> None:
    """Send shardflow's messages to the console (rank 0) and to ``log_dir`` (every rank)."""
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if rank == 0:
        console = _Console()
        console.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(log_dir) / f"rank-{rank:05d}.log", encoding="utf-8")
        file.addFilter(_Rank(rank))
        file.setFormatter(logging.Formatter(FILE_FORMAT))
        logger.addHandler(file)


def current_level() -> int:
    """The level this process logs at (what spawned ranks are given)."""
    return logging.getLogger(ROOT).getEffectiveLevel()
