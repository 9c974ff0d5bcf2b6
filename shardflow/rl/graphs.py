"""The calls every RL algorithm's graph shares: generation, reward and the reference model.

Keys and what they hold in the iteration's SequenceBatch:
  prompts       (data) prompt token ids and reference answers
  responses     input_ids (prompt + response), loss_mask, prompt_lengths, logprobs (generator's)
  rewards       seq field "rewards" (a scalar per sequence)
  baseline_responses, baseline_rewards   ReMax's greedy responses and their seq field "baseline_rewards"
  ref_logprobs  token field "ref_logprobs"
  values        token field "values" (critic)
Advantages and returns are computed at the start of each train call from these keys.
"""

from __future__ import annotations

from typing import Sequence

from shardflow.config.experiment import ExperimentConfig
from shardflow.rl.graph import Call, Kind
from shardflow.rl.rewards import reward_kind


def reward_call(config: ExperimentConfig, responses: str = "responses", rewards: str = "rewards",
                prefix: str = "reward") -> Call:
    """The reward of ``responses`` into the seq field ``rewards``: a function where they are held
    (``{prefix}_fn``), or a reward model's call (``{prefix}_inf``)."""
    model = reward_kind(config.reward.kind).model
    if model is not None:
        return Call(f"{prefix}_inf", Kind.INFERENCE, model, (responses,), (rewards,))
    return Call(f"{prefix}_fn", Kind.FUNCTION, None, (responses,), (rewards,))


def rollout_calls(config: ExperimentConfig) -> list[Call]:
    """Generate with the actor, score, and (with a KL) the reference's log-probabilities."""
    calls = [Call("actor_gen", Kind.GENERATE, "actor", ("prompts",), ("responses",)), reward_call(config)]
    if config.algorithm.kl.used:
        calls.append(Call("ref_inf", Kind.INFERENCE, "ref", ("responses",), ("ref_logprobs",)))
    return calls


def train_call(model: str, calls: Sequence[Call]) -> Call:
    """``model``'s train call, reading everything the rollout calls produced but the prompts."""
    inputs = tuple(key for c in calls for key in c.outputs)
    return Call(f"{model}_train", Kind.TRAIN, model, inputs)
