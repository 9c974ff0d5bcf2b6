"""Reward kinds, one entry each in ``REWARD_KINDS``: what ``reward.kind`` may name.

A kind either builds a reward function of the rollouts (``build(settings)``: it runs where the
rollouts are held, as the graph's ``reward_fn`` call) or names the model role that scores them
(``model``: a ``reward_inf`` inference call of that model). Adding a kind is one module with its
builder plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardflow.config.experiment import RewardConfig
from shardflow.rl.rewards.math_answer import math_reward
from shardflow.rl.rewards.scoring import RewardFn
from shardflow.rl.rewards.user import load_reward_function


@dataclass(frozen=True, kw_only=True)
class RewardKind:
    summary: str
    build: Callable[[RewardConfig], RewardFn] | None = None  # a reward function of the rollouts
    model: str | None = None  # or the model role that scores them


def _function(config: RewardConfig) -> RewardFn:
    if ":" not in config.function:
        raise ValueError(f"reward.function must look like 'module:function', got {config.function!r}")
    return load_reward_function(config.function)


REWARD_KINDS: dict[str, RewardKind] = {
    "math": RewardKind(summary="the final answer checked against data's answer with math-verify",
                       build=lambda config: math_reward(config.answer_pattern)),
    "function": RewardKind(summary="reward.function, called with (prompts, responses, answers)", build=_function),
    "model": RewardKind(summary="the score of models.reward, a sequence-classification model", model="reward"),
}


def reward_kind(name: str) -> RewardKind:
    if name not in REWARD_KINDS:
        raise ValueError(f"reward.kind must be one of {', '.join(REWARD_KINDS)}; got {name!r}")
    return REWARD_KINDS[name]


def reward_function(config: RewardConfig) -> RewardFn:
    """The reward function of ``config`` (a kind computed by a function, not by a model)."""
    kind = reward_kind(config.kind)
    if kind.build is None:
        raise ValueError(f"reward kind {config.kind!r} is computed by a reward model, not a function")
    return kind.build(config)
