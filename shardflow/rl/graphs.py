"""The dataflow graphs of PPO and GRPO, built from the experiment config.

Keys and what they hold in the iteration's SequenceBatch:
  prompts       (data) prompt token ids and reference answers
  responses     input_ids (prompt + response), loss_mask, prompt_lengths, logprobs (generator's)
  rewards       seq field "rewards" (a scalar per sequence)
  ref_logprobs  token field "ref_logprobs"
  values        token field "values" (critic)
Advantages and returns are computed at the start of each train call from these keys.
"""

from __future__ import annotations

from shardflow.config.settings import ExperimentConfig
from shardflow.rl.graph import Call, Graph, Kind


def reward_call(config: ExperimentConfig) -> Call:
    if config.reward.kind == "model":
        return Call("reward_inf", Kind.INFERENCE, "reward", ("responses",), ("rewards",))
    return Call("reward_fn", Kind.FUNCTION, None, ("responses",), ("rewards",))


def build_graph(config: ExperimentConfig) -> Graph:
    algo = config.algorithm
    use_ref = algo.kl_coef > 0 or algo.adaptive_kl_target > 0
    calls = [Call("actor_gen", Kind.GENERATE, "actor", ("prompts",), ("responses",)), reward_call(config)]
    train_inputs = ["responses", "rewards"]
    if use_ref:
        calls.append(Call("ref_inf", Kind.INFERENCE, "ref", ("responses",), ("ref_logprobs",)))
        train_inputs.append("ref_logprobs")
    if algo.name == "ppo":
        calls.append(Call("critic_inf", Kind.INFERENCE, "critic", ("responses",), ("values",)))
        train_inputs.append("values")
    calls.append(Call("actor_train", Kind.TRAIN, "actor", tuple(train_inputs)))
    if algo.name == "ppo":
        calls.append(Call("critic_train", Kind.TRAIN, "critic", tuple(train_inputs)))
    return Graph(algo.name, tuple(calls))
