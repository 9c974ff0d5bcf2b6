"""Hugging Face safetensors checkpoints in and out of a sharded model.

Load: every rank memory-maps the checkpoint and reads only its own slices (single file or
sharded with ``model.safetensors.index.json``). Every tensor is checked against the shape the
config implies before any is read; a missing or mis-shaped tensor is an error naming it.

Save: the ranks of data-parallel replica 0 send their slices to one writer rank, which
assembles full tensors under their HF names, writes sharded safetensors with an index, the
config and the tokenizer files, into a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from shardflow.config.model import ModelConfig
from shardflow.models.transformer import build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import RankShard, TensorShard, checkpoint_tensor_names, shard_for

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


class CheckpointReader:
    """Lazy, memory-mapped access to the tensors of a safetensors checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"cannot read checkpoint index {index}: {e}") from None
        elif (self.path / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")
        self._files: dict[str, object] = {}
        if weight_map is None:
            handle = self._open(SINGLE_FILE)
            weight_map = {name: SINGLE_FILE for name in handle.keys()}
        self.weight_map: dict[str, str] = weight_map

    def _open(self, filename: str):
        if filename not in self._files:
            file = self.path / filename
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint file {file} named in the index is missing")
            try:
                self._files[filename] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error type for corrupt headers
                raise ValueError(f"cannot read {file}: {e} (truncated or corrupt checkpoint?)") from None
        return self._files[filename]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor exists with the expected full shape."""
        missing = [n for n in expected if n not in self.weight_map]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"checkpoint {self.path} lacks tensor {missing[0]!r}{more}")
        for name, shape in expected.items():
            actual = self.shape(name)
            if actual != shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} in {self.path} has shape {list(actual)}, "
                    f"expected {list(shape)} from config.json"
                )

    def read(self, ts: TensorShard) -> torch.Tensor:
        """The full-tensor range of one shard (without padding)."""
        view = self._open(self.weight_map[ts.source]).get_slice(ts.source)
        try:
            return view[ts.full_slices()]
        except Exception as e:
            raise ValueError(f"cannot read tensor {ts.source!r} from {self.path}: {e} "
                             "(truncated or corrupt checkpoint?)") from None


def expected_shapes(shard: RankShard) -> dict[str, tuple[int, ...]]:
    return {ts.source: ts.full_shape for ts in shard.tensors.values()}


@torch.no_grad()
def load_weights(model: torch.nn.Module, shard: RankShard, path: str | Path) -> None:
    """Fill ``model``'s parameters with this rank's slices of the checkpoint at ``path``."""
    params = dict(model.named_parameters())
    assert set(params) == set(shard.tensors), (set(params) ^ set(shard.tensors))
    load_tensors(params, shard, path)


@torch.no_grad()
def load_tensors(tensors: dict[str, torch.Tensor], shard: RankShard, path: str | Path) -> None:
    """Fill each local tensor (named as the shard's parameters) with its slice of the full tensors
    saved at ``path`` (``save_tensors``): what resharding at load time is."""
    reader = CheckpointReader(path)
    reader.check(expected_shapes(shard))
    for name, ts in shard.tensors.items():
        local = tensors[name]
        if ts.padded:
            local.zero_()
        local[ts.local_slices()].copy_(reader.read(ts))


def _holders(cfg: ModelConfig, layout: Layout) -> dict[str, list[tuple[int, TensorShard]]]:
    """For each checkpoint tensor: which ranks of replica 0 send which distinct slice."""
    holders: dict[str, list[tuple[int, TensorShard]]] = {}
    seen: dict[str, set[tuple[int, int]]] = {}
    for rank, coord in layout.coords():
        if coord.dp != 0:
            continue
        for ts in shard_for(cfg, layout, rank).tensors.values():
            if ts.name != ts.source:  # a tied head's copy: the embedding is saved instead
                continue
            key = (ts.start, ts.stop) if ts.dim is not None else (0, 0)
            if key in seen.setdefault(ts.name, set()):
                continue  # replicated (norms, or KV heads shared by several tp ranks)
            seen[ts.name].add(key)
            holders.setdefault(ts.name, []).append((rank, ts))
    return holders


@torch.no_grad()
def save_checkpoint(model: torch.nn.Module, cfg: ModelConfig, layout: Layout, rank: int, path: str | Path,
                    *, tokenizer_dir: str | Path | None = None, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 4 << 30) -> None:
    """Write a Hugging Face checkpoint of the model. Every rank of ``layout`` calls this."""
    def extra(tmp: Path, tensor_dtype: torch.dtype) -> None:
        config = dict(cfg.hf_config)
        config["dtype"] = str(tensor_dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)

    save_tensors(dict(model.named_parameters()), cfg, layout, rank, path, dtype=dtype,
                 max_shard_bytes=max_shard_bytes, finish=extra)


@torch.no_grad()
def save_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout, rank: int, path: str | Path,
                 *, dtype: torch.dtype | None = None, max_shard_bytes: int = 4 << 30,
                 finish: Callable[[Path, torch.dtype], None] | None = None) -> None:
    """Write local tensors named and sliced as the layout's parameters (the weights, or optimizer
    state laid out like them) as full tensors under their HF names: safetensors files (with an
    index when several), in a temporary directory renamed to ``path`` once complete. The ranks
    of data-parallel replica 0 send their slices to the layout's first rank, which writes
    (``finish(tmp, dtype)`` adds files before the rename). Every rank of ``layout`` calls this."""
    path = Path(path)
    writer = layout.ranks[0]
    holders = _holders(cfg, layout)
    names = checkpoint_tensor_names(cfg)
    if rank != writer:
        for name in names:
            for holder, ts in holders[name]:
                if holder == rank:
                    dist.send(tensors[name][ts.local_slices()].contiguous(), dst=writer)
        return

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer_files = _ShardWriter(tmp, max_shard_bytes)  # a full file is written at once: one in memory
    local_dtype = next(iter(tensors.values())).dtype
    for name in names:
        first_ts = holders[name][0][1]
        full = torch.empty(first_ts.full_shape, dtype=local_dtype, device=model_device(tensors))
        for holder, ts in holders[name]:
            if holder == rank:
                full[ts.full_slices()] = tensors[name][ts.local_slices()]
            else:
                piece = torch.empty(ts.piece_shape(), dtype=full.dtype, device=full.device)
                dist.recv(piece, src=holder)
                full[ts.full_slices()] = piece
        writer_files.add(name, full.to(dtype or full.dtype).cpu())
    writer_files.close()
    if finish is not None:
        finish(tmp, dtype or local_dtype)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def model_device(params: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device


class _ShardWriter:
    """Safetensors files of at most ``max_bytes`` each (but one tensor), written as they fill;
    ``close`` names them as Hugging Face does (with an index when there are several)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, dict[str, int]]] = []  # written part -> its tensors' bytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.size += nbytes

    def _flush(self) -> None:
        part = self.directory / f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(part), metadata={"format": "pt"})
        self.files.append((part, {n: t.numel() * t.element_size() for n, t in self.pending.items()}))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.directory / SINGLE_FILE)
            return
        weight_map, total = {}, 0
        for i, (part, sizes) in enumerate(self.files):
            fname = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            part.rename(self.directory / fname)
            for name, nbytes in sizes.items():
                weight_map[name] = fname
                total += nbytes
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def load_model(path: str | Path, layout: Layout, world, dtype: torch.dtype = torch.float32,
               cfg: ModelConfig | None = None):
    """Build this rank's shard of the checkpoint at ``path`` in ``layout``.

    Returns ``(model, shard)``. The layout's groups must exist (``world.create_groups``).
    """
    cfg = cfg or ModelConfig.from_pretrained(path)
    shard = shard_for(cfg, layout, world.rank)
    model = build_model(cfg, shard, world.groups.get(layout.tp_group(world.rank)), world.device, dtype)
    load_weights(model, shard, path)
    return model, shard
