"""Atomic run checkpoints: a kill at any moment leaves the previous checkpoint usable.

Layout under ``<out_dir>/checkpoints``:

    iter-000010/          one complete checkpoint:
        actor/            HF weights (safetensors) and tokenizer of each trained model
        actor-optimizer/  its optimizer state by tensor name: master/, exp_avg/, exp_avg_sq/
                          (full tensors under the HF names) and optimizer.json (the step)
        ranks/            each rank's random generators and length predictors (JSON)
        state.json        iteration, data position, KL controller, format
    latest                name of the newest complete checkpoint (replaced atomically)
    tmp-000012/           a checkpoint being written (ignored, removed on the next save)

Nothing in it is pickled, and nothing depends on the layout it was written under: a run resumes
under another plan or device count, each rank reading its own slices.

Every rank writes its own files into ``tmp-N``; after a barrier the first rank renames it to
``iter-N`` and only then points ``latest`` at it. Resume reads ``latest``, nothing else.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"
CHECKPOINT_FORMAT = 2  # 2: optimizer state by tensor name, no pickle (1: one pickle per rank)


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def staging_dir(out_dir: Path, iteration: int) -> Path:
    return checkpoint_root(out_dir) / f"tmp-{iteration:06d}"


def final_dir(out_dir: Path, iteration: int) -> Path:
    return checkpoint_root(out_dir) / f"iter-{iteration:06d}"


def begin(out_dir: Path, iteration: int) -> Path:
    """First rank only: a fresh staging directory for this iteration's checkpoint."""
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = staging_dir(out_dir, iteration)
    staging.mkdir()
    return staging


def commit(out_dir: Path, iteration: int, keep: int) -> Path:
    """First rank only, after every rank finished writing: publish and prune."""
    staging, final = staging_dir(out_dir, iteration), final_dir(out_dir, iteration)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    pointer = checkpoint_root(out_dir) / LATEST
    tmp_pointer = pointer.with_suffix(".tmp")
    tmp_pointer.write_text(final.name + "\n")
    os.replace(tmp_pointer, pointer)
    _fsync_dir(final.parent)
    complete = sorted(p for p in checkpoint_root(out_dir).glob("iter-*") if p.is_dir())
    later = [p for p in complete if iteration_of(p) > iteration]  # an earlier run's, replaced by a fresh start
    earlier = [p for p in complete if iteration_of(p) <= iteration]
    for old in later + earlier[: max(0, len(earlier) - max(keep, 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(out_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = checkpoint_root(out_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_root(out_dir) / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist")
    return path


def iteration_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
