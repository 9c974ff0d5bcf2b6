"""The train call: advantages over the whole batch, then epochs x mini-batches of optimizer steps.

The algorithm's estimator sees the replica's share and exchanges what needs the whole batch over
the data-parallel group; its loss for the call's model role is what the steps optimise.
"""

from __future__ import annotations

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.rl.advantages import sequence_kl
from shardflow.rl.rewards.shaping import shape_overlong
from shardflow.runtime.calls.budget import token_budget
from shardflow.runtime.calls.context import CallContext
from shardflow.runtime.calls.inference import lm_temperature


def run_train(ctx: CallContext) -> SequenceBatch | None:
    engine = ctx.slot.engine if ctx.model is not None else None
    if engine is None:
        return None
    world, layout, algo, role = ctx.world, ctx.layout, ctx.config.algorithm, ctx.call.model
    kl_coef, max_len = ctx.state.kl.value, ctx.config.generation.max_new_tokens
    dp_group = world.groups.get(layout.dp_group(world.rank))
    batch = ctx.batch.to("cpu")
    if ctx.algorithm.online:
        if "ref_logprobs" in batch.token_fields:  # what the adaptive KL controller follows
            ctx.report.metrics[f"{role}/sequence_kl"] = sequence_kl(batch, group=dp_group)
        overlong = algo.overlong
        if overlong.buffer or overlong.filter:
            batch = shape_overlong(batch, max_len=max_len, buffer=overlong.buffer or 0, penalty=overlong.penalty,
                                   filter_truncated=bool(overlong.filter))
    batch, measured = ctx.algorithm.advantages(batch, algo, kl_coef, dp_group)
    ctx.report.metrics.update({f"{role}/{k}": v for k, v in measured.items()})
    loss_fn = ctx.algorithm.loss(role, algo, kl_coef, norm_length=max_len)
    temperature = 1.0 if ctx.model.cfg.value_head else lm_temperature(ctx)
    order = torch.argsort(batch.sample_ids)
    parts = [order[i::algo.mini_batches] for i in range(algo.mini_batches)]
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(algo.epochs):
        for part in parts:
            if len(part) == 0:
                raise ValueError(f"{ctx.call.name}: a replica of {layout} got fewer sequences than "
                                 f"algorithm.mini_batches={algo.mini_batches}")
            mini = batch.select(part)
            budget = token_budget(ctx, mini, training=True)
            metrics = engine.step(mini, loss_fn, micro_batch_tokens=budget, temperature=temperature,
                                  share_prompts=algo.share_prompts, attention=algo.packed_attention)
            metrics["micro_batch_tokens"] = float(budget)  # what an unset budget came to on this device
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            steps += 1
    ctx.report.metrics.update({f"{role}/{k}": v / steps for k, v in sums.items()})
    return None
