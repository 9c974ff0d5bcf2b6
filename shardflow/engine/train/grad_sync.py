"""Gradient rules that come from the sharding spec, applied after backward.

Data-parallel reduction happens in ``GradBuffer``; what remains is:

- tensors whose tp ranks hold partial gradients (``TensorShard.partial_grad_tp``: Qwen3 q/k
  norms, KV projections replicated when tp exceeds the KV heads) are summed over those ranks;
- a tied embedding split over pipeline stages (the last stage's ``lm_head.weight`` copies the
  first stage's ``model.embed_tokens.weight``) gets the sum of both gradients on both copies;
- the global gradient norm counts each distinct parameter element once.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from shardflow.config.model import ModelConfig
from shardflow.engine.train.grad_buffer import GradBuffer
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import EMBED, LM_HEAD, RankShard


@torch.no_grad()
def sum_partial_tp_grads(grads: GradBuffer, shard: RankShard, tp_group: ProcessGroup | None) -> None:
    """One all-reduce over the tp group of a buffer holding, per partial tensor, a zero tensor of
    the full tensor's shape with this rank's gradient at its slice. Ranks holding the same slice
    are exactly the ones whose partial gradients must be summed, and distinct slices do not
    overlap, so reading the own slice back gives the sum. Costs the full tensor's size where a
    KV head is shared; every rank of a stage has the same partial tensors, so all join.
    """
    partial = [ts for ts in shard.tensors.values() if ts.partial_grad_tp]
    if not partial or tp_group is None:
        return
    sizes = [torch.Size(ts.full_shape).numel() for ts in partial]
    buffer = grads.flat.new_zeros(sum(sizes))  # [sum of full sizes of partial tensors]
    regions = [r.view(ts.full_shape) for r, ts in zip(buffer.split(sizes), partial)]
    for region, ts in zip(regions, partial):
        region[ts.full_slices()] = grads.views[ts.name][ts.local_slices()]
    comm.all_reduce(buffer, tp_group)
    for region, ts in zip(regions, partial):
        grads.views[ts.name][ts.local_slices()] = region[ts.full_slices()]


def tied_across_stages(cfg: ModelConfig, layout: Layout) -> bool:
    """Whether the last stage holds its own copy of the embedding as the LM head."""
    return cfg.tie_word_embeddings and not cfg.value_head and layout.pp > 1


@torch.no_grad()
def sum_tied_embedding_grads(grads: GradBuffer, cfg: ModelConfig, shard: RankShard, layout: Layout,
                             pp_group: ProcessGroup | None) -> None:
    """First and last stage swap their gradients of the tied embedding by point-to-point (same dp
    and tp index) and add them: a + b on one side, b + a on the other, bitwise equal, so the two
    copies get the same update and stay identical."""
    if not tied_across_stages(cfg, layout) or not (shard.first_stage or shard.last_stage):
        return
    c = shard.coord
    if shard.first_stage:
        name, peer = EMBED, layout.rank_at(layout.pp - 1, c.dp, c.tp)
    else:
        name, peer = LM_HEAD, layout.rank_at(0, c.dp, c.tp)
    mine = grads.views[name]
    [theirs] = comm.exchange([(mine, peer)], [(tuple(mine.shape), mine.dtype, mine.device, peer)], pp_group)
    mine.add_(theirs)


def global_grad_norm(counted: list[torch.Tensor], layout_group: ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """sqrt of the sum of squares of every distinct gradient element of the model (0-d tensor).

    ``counted``: this rank's gradient views that it alone counts (see ``unique_tensors``; only
    data-parallel replica 0 counts, the replicas being identical after reduction). One
    all-reduce of a single float over all ranks of the layout.
    """
    if counted:
        total = torch.stack(torch._foreach_norm(counted)).pow(2).sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    comm.all_reduce(total, layout_group)
    return total.sqrt()
