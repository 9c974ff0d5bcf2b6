"""Where a call's data lives and how it reaches the calls that read it.

Data keys live where their call produced them: on each DP replica's holder (last stage, tp index
0) of the producer's layout, as a ``Held`` batch. Right after a model call, its outputs are
redistributed from its holders to the DP replicas of every model call that reads them (one
redistribution per producer layout; the samples' assignment depends only on the samples, so a
consumer's inputs join by sample id). A function call runs at the holders of its input instead.

Every function here is called on every rank, in the run's one global order; a rank outside a
layout passes through the collectives it takes part in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.parallel.layout import Layout
from shardflow.parallel.redistribute import assign_shares, redistribute, redistribute_groups, source_holders
from shardflow.parallel.world import World
from shardflow.plan.execution_plan import ExecutionPlan
from shardflow.rl.graph import Call, Graph, Kind

# Per-token fields an inference call needs from its inputs (everything else stays home): the ids,
# and the response tokens, the only ones whose outputs are read.
INFERENCE_FIELDS = ("input_ids", "loss_mask")


@dataclass
class Held:
    """Where a key's data lives: the producer's layout, and this rank's part if it is a holder."""

    layout: Layout
    batch: SequenceBatch | None


def is_holder(layout: Layout, rank: int) -> bool:
    return rank in source_holders(layout)


def communication_groups(graph: Graph, plan: ExecutionPlan) -> list[tuple[int, ...]]:
    """Process groups the run needs besides the layouts' own: one per (producer, consumer) pair
    that redistributes data."""
    groups: list[tuple[int, ...]] = []
    layout_of = {c.name: plan[c.name].layout for c in graph.model_calls()}
    for call in graph.model_calls():
        for producer in graph.dependencies(call):
            src = _holding_layout(graph, producer, layout_of)
            groups += redistribute_groups(src, layout_of[call.name])
    return groups


def _holding_layout(graph: Graph, name: str, layout_of: dict[str, Layout]) -> Layout:
    """Function calls hold their outputs where their input's producer holds it."""
    call = graph.call(name)
    while call.kind is Kind.FUNCTION:
        call = graph.call(graph.dependencies(call)[0])
    return layout_of[call.name]


def source_share(batch: SequenceBatch, layout: Layout, rank: int) -> SequenceBatch:
    """This rank's replica's share of a batch every rank holds whole (data rows as sequences): the
    same assignment ``redistribute`` makes of those samples, so it joins with what other calls
    send."""
    shares = assign_shares([batch.lengths.tolist()], layout.dp, None, [batch.sample_ids.tolist()])
    return batch.select([i for _, i in shares[layout.coord(rank).dp]])


def join(parts: list[SequenceBatch]) -> SequenceBatch:
    """Batches of the same samples (any order) merged field by field, in sample-id order."""
    parts = [p.sorted_by_id() for p in parts]
    first = parts[0]
    for p in parts[1:]:
        if not torch.equal(p.sample_ids.cpu(), first.sample_ids.cpu()):
            raise RuntimeError("inputs of one call hold different samples; the redistribution diverged")
    tokens, seqs, meta = {}, {}, {}
    for p in parts:
        tokens.update(p.token_fields)
        seqs.update(p.seq_fields)
        meta.update(p.meta)
    return SequenceBatch(first.sample_ids, first.lengths, tokens, seqs, meta)


def consumers(graph: Graph, call: Call) -> list[Call]:
    """Model calls reading an output of ``call`` (function calls read at the holders instead)."""
    return [c for c in graph.model_calls() if set(c.inputs) & set(call.outputs)]


def push_outputs(world: World, graph: Graph, plan: ExecutionPlan, call: Call, layout: Layout,
                 out: SequenceBatch | None, inbox: dict[str, list[SequenceBatch]], *,
                 to: Sequence[str] | None = None) -> None:
    """Send a call's outputs from its holders to the replicas of every call that reads them (of
    the calls named in ``to`` only, if given), right after it ran: a consumer's ranks receive
    early and keep the data until their call, so the producer's ranks never wait for the
    consumer's turn (calls on disjoint devices stay overlapped)."""
    for consumer in consumers(graph, call):
        if to is not None and consumer.name not in to:
            continue
        local = None
        if is_holder(layout, world.rank):
            local = out
            if consumer.kind is Kind.INFERENCE:  # all an inference call needs
                local = SequenceBatch(out.sample_ids, out.lengths,
                                      {k: v for k, v in out.token_fields.items() if k in INFERENCE_FIELDS})
        share = redistribute(world, local, layout, plan[consumer.name].layout)
        if share is not None:
            inbox[consumer.name].append(share)
