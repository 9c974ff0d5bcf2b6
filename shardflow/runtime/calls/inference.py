"""Inference calls: a model's forward over the rollouts, by the key the call writes.

``ref_logprobs``: the reference model's log-probabilities of the response tokens; ``values``:
the critic's values; ``rewards``: a reward model's score of each sequence. Outputs stay on the
call's holders.
"""

from __future__ import annotations

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.engine.inference import infer
from shardflow.runtime.calls.budget import token_budget
from shardflow.runtime.calls.context import CallContext
from shardflow.runtime.calls.data import is_holder


def lm_temperature(ctx: CallContext) -> float:
    """The temperature that the generator's log-probabilities were taken at (1 offline: the data
    rows come from no sampler)."""
    return max(ctx.config.generation.temperature, 1e-6) if ctx.algorithm.online else 1.0


def _per_token(ctx: CallContext, what: str, key: str) -> SequenceBatch | None:
    batch, algo = ctx.batch, ctx.config.algorithm
    out = infer(ctx.model, ctx.layout, ctx.world, batch, what,
                micro_batch_tokens=token_budget(ctx, batch, training=False),
                temperature=lm_temperature(ctx) if what == "logprobs" else 1.0,
                outputs_at="loss_mask",  # the losses and advantages read response tokens only
                share_prompts=algo.share_prompts, attention=algo.packed_attention)
    if out is None or not is_holder(ctx.layout, ctx.world.rank):
        return None
    return SequenceBatch(batch.sample_ids, batch.lengths, {key: out.token_fields[what].float().cpu()})


def _sequence_scores(ctx: CallContext) -> SequenceBatch | None:
    """A reward model's score of a sequence: its value head after reading the last token (plus an
    episode's environment reward). The
    shifted per-token values put that one position past the end, so one pad token is appended."""
    batch = ctx.batch
    offsets = batch.offsets.tolist()
    ids = batch.token_fields["input_ids"]
    padded = SequenceBatch.from_lists(batch.sample_ids.tolist(), {"input_ids": [
        torch.cat([ids[offsets[i]:offsets[i + 1]], ids.new_zeros(1)]) for i in range(len(batch))]})
    out = infer(ctx.model, ctx.layout, ctx.world, padded, "values",
                micro_batch_tokens=token_budget(ctx, padded, training=False))
    if out is None or not is_holder(ctx.layout, ctx.world.rank):
        return None
    last = out.offsets[1:] - 1  # the appended position
    scores = out.token_fields["values"][last.to(out.token_fields["values"].device)].float().cpu()
    if "env_rewards" in batch.seq_fields:  # an episode's environment reward adds to the model's score
        scores = scores + batch.seq_fields["env_rewards"].float()
    (key,) = ctx.call.outputs
    if key == "rewards":
        ctx.report.rollout["reward"] = scores.tolist()
    return SequenceBatch(batch.sample_ids, batch.lengths, {}, {key: scores})


# the key an inference call writes -> how it is computed
OUTPUTS = {
    "ref_logprobs": lambda ctx: _per_token(ctx, "logprobs", "ref_logprobs"),
    "logprobs": lambda ctx: _per_token(ctx, "logprobs", "logprobs"),  # the policy's own (offline algorithms)
    "values": lambda ctx: _per_token(ctx, "values", "values"),
    "rewards": _sequence_scores,
    "baseline_rewards": _sequence_scores,
}


def run_inference(ctx: CallContext) -> SequenceBatch | None:
    if ctx.model is None:
        return None
    (key,) = ctx.call.outputs
    if key not in OUTPUTS:
        raise ValueError(f"inference call {ctx.call.name!r} writes {key!r}; inference computes "
                         f"{', '.join(OUTPUTS)}")
    return OUTPUTS[key](ctx)
