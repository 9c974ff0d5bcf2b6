"""One model role of a run: where it lives, and the copies its calls use.

A trained model's home is the layout of its train call: its optimizer state stays there. A frozen
model's home is the layout of its first call. Any other call of the model gets a copy in its own
layout, refreshed from home by reallocation before the call (buffers reused across iterations)
and released after it, so that only the home copy occupies memory between calls. Frozen models may
also be offloaded to host memory between their calls.

Every method that moves weights is collective over the source and destination ranks: all ranks
call it, in the run's one global order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shardflow.config.experiment import ModelSpec
from shardflow.config.model import ModelConfig
from shardflow.engine.train import kernel_warmup
from shardflow.engine.train.engine import TrainEngine
from shardflow.models.checkpoint import load_model
from shardflow.models.reallocate import reallocate_model
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.offload import HostOffload, release_storage
from shardflow.parallel.world import World


def compute_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    if spec.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec.dtype)


@dataclass
class MoveStats:
    """What the last ``model_for`` cost on this rank."""

    seconds: float = 0.0
    bytes_moved: int = 0
    gbps: float = 0.0


@dataclass
class ModelSlot:
    world: World
    role: str
    spec: ModelSpec
    cfg: ModelConfig
    home: Layout
    dtype: torch.dtype
    home_model: Transformer | None = None
    engine: TrainEngine | None = None
    copies: dict[Layout, Transformer | None] = field(default_factory=dict)
    offloader: HostOffload | None = None
    last_move: MoveStats = field(default_factory=MoveStats)

    @classmethod
    def load(cls, world: World, role: str, spec: ModelSpec, cfg: ModelConfig, home: Layout, *,
             trained: bool) -> "ModelSlot":
        """Load the checkpoint into the home layout; build the training engine if ``trained``."""
        slot = cls(world, role, spec, cfg, home, compute_dtype(spec, world.device))
        if world.rank in home:
            slot.home_model, _ = load_model(spec.path, home, world, slot.dtype, cfg=cfg)
            if trained:  # while the layers compile below and the first calls run
                kernel_warmup.start(slot.home_model)
            slot._maybe_compile(slot.home_model)
            if trained:
                slot.engine = TrainEngine(slot.home_model, home, world, spec.optim,
                                          gradient_checkpointing=spec.gradient_checkpointing,
                                          shard_optimizer=spec.shard_optimizer,
                                          offload_optimizer=spec.offload_optimizer)
            elif spec.offload:
                slot.offloader = HostOffload(slot.home_model)
        return slot

    def model_for(self, layout: Layout) -> Transformer | None:
        """This rank's model in ``layout`` (None if the rank is not in it), with current weights."""
        start = time.perf_counter()
        if layout == self.home:
            if self.offloader is not None and self.offloader.offloaded:
                stats = self.offloader.restore()
                self.last_move = MoveStats(time.perf_counter() - start, stats.bytes_copied, stats.gbps)
            else:
                self.last_move = MoveStats()
            return self.home_model
        if self.offloader is not None and self.offloader.offloaded:
            self.offloader.restore()
        new = layout not in self.copies
        copy, stats = reallocate_model(self.world, self.cfg, self.home, layout, self.home_model,
                                       self.copies.get(layout), dtype=self.dtype)
        self.copies[layout] = copy
        if new and copy is not None:
            self._maybe_compile(copy)
        self.last_move = MoveStats(time.perf_counter() - start, stats.bytes_received, stats.gbps)
        return copy

    def _maybe_compile(self, model: Transformer) -> None:
        # tp = 1 only: tracing the layers' tp collectives is not worth the risk of ranks diverging.
        if self.spec.compile and self.world.device.type == "cuda" and model.shard.tp_size == 1:
            model.compile_layers()

    def done_with(self, layout: Layout) -> None:
        """After a call: free the call's copy (kept as an object for reuse), offload if asked."""
        copy = self.copies.get(layout)
        if copy is not None:
            release_storage(copy.parameters())
        if layout == self.home and self.offloader is not None:
            self.offloader.offload()
