from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pool import RankPool  # noqa: E402

POOL_SIZE = 8


@pytest.fixture(scope="session")
def pool():
    p = RankPool(POOL_SIZE)
    yield p
    p.close()


class Checkpoints:
    """Tiny random checkpoints, built once per session on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._made: dict[str, Path] = {}

    def get(self, name: str, family: str = "llama", **kwargs) -> str:
        if name not in self._made:
            from shardflow.models.tiny import make_tiny_checkpoint

            self._made[name] = make_tiny_checkpoint(self.root / name, family, **kwargs)
        return str(self._made[name])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))
