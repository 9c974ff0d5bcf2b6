"""Forward passes under any (pp, dp, tp) for inference calls.

Each data-parallel replica runs its own micro-batches; inside a replica, stage s receives the
hidden states of stage s - 1 by point-to-point from the rank with the same tp index, runs its
layers and sends them on. Only the last stage's ranks get results.
"""

from __future__ import annotations

import torch

from shardflow.models.transformer import Transformer
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout


@torch.no_grad()
def pipeline_forward(model: Transformer, layout: Layout, rank: int,
                     micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
    """Hidden states [B,T,H] of the last stage for each micro-batch of (ids [B,T], positions [B,T]).

    Every rank of the replica must pass the same micro-batch shapes; returns None off the last stage.
    """
    c = layout.coord(rank)
    first, last = c.pp == 0, c.pp == layout.pp - 1
    prev = None if first else layout.rank_at(c.pp - 1, c.dp, c.tp)
    nxt = None if last else layout.rank_at(c.pp + 1, c.dp, c.tp)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    outputs = []
    for ids, positions in micro_batches:
        ids, positions = ids.to(device), positions.to(device)
        if first:
            x = ids
        else:
            x = comm.recv((*ids.shape, model.cfg.hidden_size), dtype, device, prev)
        h = model(x, positions)
        if last:
            outputs.append(h)
        else:
            comm.send(h, nxt)
    return outputs if last else None
