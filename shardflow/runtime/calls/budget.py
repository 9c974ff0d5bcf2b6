"""The token budget of a model call's micro-batches.

In order: the plan's micro-batch count for the call, the run's ``algorithm.micro_batch_tokens``,
or (unset) the most tokens whose activations fit in the device's free memory at the call
(``plan.memory.auto_micro_batch_tokens``): the fewer micro-batches, the fewer kernel launches and
gradient accumulations per step. The ranks of the call's layout agree on one budget (the
smallest), so that every stage and tp shard of a replica splits its batch alike.
"""

from __future__ import annotations

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.parallel.comm import ReduceOp, all_reduce
from shardflow.parallel.device_memory import free_bytes
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.plan.memory import Precision, auto_micro_batch_tokens
from shardflow.runtime.calls.context import CallContext

CPU_TOKENS = 8192  # unset on CPU ranks, which have no device memory to size by


def token_budget(ctx: CallContext, batch: SequenceBatch, *, training: bool) -> int:
    """Padded tokens per micro-batch of this rank's share of the call; never less than its longest
    sequence. Every rank of the call's layout calls it at the same point (it may all-reduce)."""
    longest = int(batch.lengths.max()) if len(batch) else 1
    if ctx.micro_batches is not None:  # about that many micro-batches per replica
        return max(longest, -(-batch.num_tokens // ctx.micro_batches))
    setting = ctx.config.algorithm.micro_batch_tokens
    if setting is not None:
        return max(longest, setting)
    return max(longest, auto_budget(ctx, training=training))


def auto_budget(ctx: CallContext, *, training: bool) -> int:
    device = ctx.world.device
    if device.type != "cuda":
        return CPU_TOKENS
    model = ctx.model
    item = next(model.parameters()).element_size()
    tokens = auto_micro_batch_tokens(model.cfg, ctx.layout, free_bytes(device), training=training,
                                     checkpointing=training and model.gradient_checkpointing,
                                     p=Precision(activation_bytes=item))
    return smallest_over(ctx.world, ctx.layout, tokens)


def smallest_over(world: World, layout: Layout, value: int) -> int:
    """The smallest of each rank's ``value`` over the ranks of ``layout`` (every one of them calls it)."""
    t = all_reduce(torch.tensor([value], device=world.device), world.groups.get(layout.ranks), ReduceOp.MIN)
    return int(t)
