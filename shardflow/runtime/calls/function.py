"""Function calls: plain Python over a batch, run where its input is held (no model, no layout of
its own), one entry per call name in ``FUNCTIONS``."""

from __future__ import annotations

from shardflow.data.batch import SequenceBatch
from shardflow.rl.rewards.scoring import score_batch
from shardflow.runtime.calls.context import CallContext


def rule_rewards(ctx: CallContext) -> SequenceBatch | None:
    """The reward function's score of each held rollout, as the seq field the call writes
    (``rewards``, or ReMax's ``baseline_rewards``)."""
    batch, (key,) = ctx.batch, ctx.call.outputs
    scores = score_batch(batch, ctx.state.tokenizer, ctx.state.reward_fn, error_value=ctx.config.reward.error_value)
    if key == "rewards":
        ctx.report.rollout["reward"] = scores.rewards.tolist()
    if scores.errors:
        ctx.report.metrics["reward/errors"] = float(scores.errors)
        ctx.report.errors.append(f"the reward function raised for {scores.errors} of {len(batch)} responses "
                                 f"(given reward.error_value={ctx.config.reward.error_value}): {scores.first_error}")
    return SequenceBatch(batch.sample_ids, batch.lengths, {}, {key: scores.rewards})


FUNCTIONS = {"reward_fn": rule_rewards, "baseline_reward_fn": rule_rewards}


def run_function(ctx: CallContext) -> SequenceBatch | None:
    if ctx.batch is None:  # not a holder of the input
        return None
    if ctx.call.name not in FUNCTIONS:
        raise ValueError(f"no function for call {ctx.call.name!r}; known: {', '.join(FUNCTIONS)}")
    return FUNCTIONS[ctx.call.name](ctx)
