"""The weights of a merged layout: views of the starting layout's tensors, or a reallocated copy.

Generation never changes the weights, so every layout a generation switches to can be derived from
the model it started in (the *start* model). When a target layout nests in the start layout
(``merge.nests``), each rank builds the target's model from views of its own start tensors, cut to
the target's ``shard_for`` ranges: no memory, no copy, nothing sent. Weights refreshed in place in
the start model (reallocation into it before the next iteration) show through the views. A
row-parallel weight narrowed along its input columns is a strided view whose leading dimension is
the start width; GEMMs read it as it is.

A target that does not nest gets a model of its own, allocated once and filled from the start
model by ``reallocate`` at each switch (point-to-point over the default group; every rank of the
layout takes part).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.merge import narrow_offset, nests
from shardflow.models.reallocate import reallocate_model
from shardflow.models.transformer import Transformer, build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.realloc import ReallocStats
from shardflow.parallel.sharding import shard_for


@torch.no_grad()
def view_model(cfg: ModelConfig, start_model: Transformer, dst: Layout, rank: int,
               group: ProcessGroup | None) -> Transformer:
    """This rank's model in ``dst`` whose every parameter is a view of ``start_model``'s."""
    start = start_model.shard.layout
    if not nests(cfg, start, dst):
        raise ValueError(f"{dst} does not nest in {start}: its weights cannot be views of the start model's")
    shard = shard_for(cfg, dst, rank)
    with torch.device("meta"):
        model = Transformer(cfg, shard, group)
    params = dict(start_model.named_parameters())
    for name, ts in shard.tensors.items():
        base = params[name]
        view = base if ts.dim is None else base.narrow(ts.dim, narrow_offset(cfg, start, dst, rank, name),
                                                       ts.local_shape[ts.dim])
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = nn.Parameter(view, requires_grad=False)
    model.inv_freq = start_model.inv_freq
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers())), "a parameter was left unset"
    return model


def allocated_model(cfg: ModelConfig, dst: Layout, rank: int, group: ProcessGroup | None,
                    like: Transformer) -> Transformer:
    """Storage for this rank's model in ``dst`` (filled by ``refill``), on ``like``'s device and dtype."""
    param = next(like.parameters())
    return build_model(cfg, shard_for(cfg, dst, rank), group, param.device, param.dtype)


def refill(world, cfg: ModelConfig, start_model: Transformer, dst: Layout, dst_model: Transformer) -> ReallocStats:
    """Copy the start model's weights into ``dst_model`` by reallocation. Collective: every rank of
    both layouts calls it."""
    _, stats = reallocate_model(world, cfg, start_model.shard.layout, dst, start_model, dst_model)
    return stats


def param_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
