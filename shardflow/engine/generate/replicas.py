"""Generation over a whole layout: requests split across data-parallel replicas, results gathered.

Every rank of the layout calls ``generate_replicated`` with the same requests. Prompt groups are
dealt to replicas round-robin (all samples of a prompt stay together, to share their prefill);
each replica's engine generates its share; then the holder of each replica (tp index 0) sends
its finished requests to the layout's first rank: one ``gather_object`` over the tp-index-0 ranks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.distributed as dist

from shardflow.engine.generate.engine import GenerationEngine
from shardflow.engine.generate.requests import Request
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World


def replica_share(requests: Sequence[Request], dp: int, replica: int) -> list[Request]:
    """The requests replica ``replica`` of ``dp`` generates: prompt groups dealt round-robin."""
    order = {g: i for i, g in enumerate(dict.fromkeys(r.group for r in requests))}
    return [r for r in requests if order[r.group] % dp == replica]


def generate_replicated(engine: GenerationEngine, layout: Layout, world: World, requests: Sequence[Request],
                        on_finish: Callable[[Request], None] | None = None) -> list[Request] | None:
    """Generate ``requests`` across the replicas of ``layout``.

    Returns, on the layout's first rank, every request finished (sorted by ``request_id``; the
    objects are this rank's, filled in from their replicas); None on the other ranks.
    """
    if layout.pp != 1:
        raise ValueError(f"generation with pipeline parallelism is not supported (layout {layout}); use pp=1")
    c = layout.coord(world.rank)
    mine = replica_share(requests, layout.dp, c.dp)
    engine.generate(mine, on_finish)
    if c.tp != 0:
        return None
    group = world.groups.get(layout.dp_group(world.rank))  # the replicas' holders
    dst = layout.ranks[0]
    results = result_states(mine)
    if group is None:
        gathered = [results]
    else:
        gathered = [None] * layout.dp if world.rank == dst else None
        dist.gather_object(results, gathered, dst=dst, group=group)
    if world.rank != dst:
        return None
    return fill_results(requests, gathered)


def result_states(requests: Sequence[Request]) -> list[tuple]:
    """What a replica sends of its finished requests: (id, tokens, log-probabilities, finish reason,
    the spans of an episode's observations)."""
    return [(r.request_id, r.output_ids, r.output_logprobs, r.finish_reason, r.observation_spans) for r in requests]


def fill_results(requests: Sequence[Request], parts: Sequence[list[tuple]]) -> list[Request]:
    """Fill ``requests`` from the replicas' ``result_states``; returns them sorted by id."""
    by_id = {r.request_id: r for r in requests}
    for part in parts:
        for request_id, output_ids, logprobs, finish_reason, spans in part:
            r = by_id[request_id]
            r.output_ids, r.output_logprobs, r.finish_reason = output_ids, logprobs, finish_reason
            r.observation_spans = spans
    return sorted(requests, key=lambda r: r.request_id)
