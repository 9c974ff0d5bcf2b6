"""Function calls: plain Python over a batch, run where its input is held (no model, no layout of
its own), one entry per call name in ``FUNCTIONS``."""

from __future__ import annotations

from shardflow.data.batch import SequenceBatch
from shardflow.rl.rewards.scoring import score_batch
from shardflow.runtime.calls.context import CallContext


def rule_rewards(ctx: CallContext) -> SequenceBatch | None:
    """The reward of each held rollout, as the seq field the call writes (``rewards``, or ReMax's
    ``baseline_rewards``): the reward functions' score (already computed in the worker pool as
    the responses finished, when the rollouts carry ``response_rewards``), plus an episode's
    environment reward (``env_rewards``)."""
    batch, (key,) = ctx.batch, ctx.call.outputs
    fields = batch.seq_fields
    if "response_rewards" in fields:  # scored during generation; its errors were reported there
        rewards = fields["response_rewards"].float()
    else:
        scores = score_batch(batch, ctx.state.tokenizer, ctx.state.reward_fn,
                             error_value=ctx.config.reward.error_value)
        rewards = scores.rewards
        if scores.errors:
            ctx.report.metrics["reward/errors"] = float(scores.errors)
            ctx.report.errors.append(f"the reward function raised for {scores.errors} of {len(batch)} responses "
                                     f"(given reward.error_value={ctx.config.reward.error_value}): "
                                     f"{scores.first_error}")
    if "env_rewards" in fields:
        rewards = rewards + fields["env_rewards"].float()
    if key == "rewards":
        ctx.report.rollout["reward"] = rewards.tolist()
    return SequenceBatch(batch.sample_ids, batch.lengths, {}, {key: rewards})


FUNCTIONS = {"reward_fn": rule_rewards, "baseline_reward_fn": rule_rewards}


def run_function(ctx: CallContext) -> SequenceBatch | None:
    if ctx.batch is None:  # not a holder of the input
        return None
    if ctx.call.name not in FUNCTIONS:
        raise ValueError(f"no function for call {ctx.call.name!r}; known: {', '.join(FUNCTIONS)}")
    return FUNCTIONS[ctx.call.name](ctx)
