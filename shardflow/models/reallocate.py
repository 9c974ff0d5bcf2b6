"""Reallocating a whole model: ``parallel.realloc.reallocate`` on ``Transformer`` modules.

The destination model is built on first use (its storage allocated, nothing initialised) and
then refilled in place on every later reallocation, so that buffers are reused across calls.
"""

from __future__ import annotations

import torch

from shardflow.config.model import ModelConfig
from shardflow.models.transformer import Transformer, build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.realloc import ReallocStats, reallocate
from shardflow.parallel.realloc_plan import transfer_plan
from shardflow.parallel.sharding import shard_for
from shardflow.parallel.world import World


def reallocate_model(world: World, cfg: ModelConfig, src: Layout, dst: Layout, src_model: Transformer | None,
                     dst_model: Transformer | None = None, *, dtype: torch.dtype | None = None,
                     release_src: bool = False, **options) -> tuple[Transformer | None, ReallocStats]:
    """``reallocate`` on ``Transformer`` modules; returns ``(dst_model, stats)``.

    A rank of ``dst`` given no ``dst_model`` gets a new one of ``dtype`` (its layout's groups must
    exist: ``world.create_groups``). Ranks outside a layout pass None for its model.
    """
    me = world.rank
    for role, model, layout in (("source", src_model, src), ("destination", dst_model, dst)):
        if model is None:
            continue
        if model.cfg != cfg:
            raise ValueError(f"the {role} model is a different model ({model.cfg.architecture}, "
                             f"{model.cfg.num_layers} layers, hidden {model.cfg.hidden_size}) than the one "
                             f"being reallocated ({cfg.architecture}, {cfg.num_layers} layers, "
                             f"hidden {cfg.hidden_size})")
        if model.shard.layout != layout:
            raise ValueError(f"the {role} model on rank {me} is laid out as {model.shard.layout}, not {layout}")
    if me in dst and dst_model is None:
        if dtype is None:
            raise ValueError("dtype is needed to build the destination model")
        transfer_plan(cfg, src, dst)  # bad layouts are reported before anything is allocated
        dst_model = build_model(cfg, shard_for(cfg, dst, me), world.groups.get(dst.tp_group(me)),
                                world.device, dtype)
    src_params = dict(src_model.named_parameters()) if src_model is not None else None
    dst_params = dict(dst_model.named_parameters()) if dst_model is not None else None
    stats = reallocate(world, cfg, src, dst, src_params, dst_params, release_src=release_src, **options)
    return dst_model, stats
