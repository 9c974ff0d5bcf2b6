"""Function calls: plain Python over a batch, run where its input is held (no model, no layout of
its own), one entry per call name in ``FUNCTIONS``."""

from __future__ import annotations

from shardflow.data.batch import SequenceBatch
from shardflow.rl.rewards.scoring import score_batch
from shardflow.runtime.calls.context import CallContext


def rule_rewards(ctx: CallContext) -> SequenceBatch | None:
    """The reward function's score of each held rollout."""
    batch = ctx.batch
    rewards = score_batch(batch, ctx.state.tokenizer, ctx.state.reward_fn)
    ctx.report.rollout["reward"] = rewards.tolist()
    return SequenceBatch(batch.sample_ids, batch.lengths, {}, {"rewards": rewards})


FUNCTIONS = {"reward_fn": rule_rewards}


def run_function(ctx: CallContext) -> SequenceBatch | None:
    if ctx.batch is None:  # not a holder of the input
        return None
    if ctx.call.name not in FUNCTIONS:
        raise ValueError(f"no function for call {ctx.call.name!r}; known: {', '.join(FUNCTIONS)}")
    return FUNCTIONS[ctx.call.name](ctx)
