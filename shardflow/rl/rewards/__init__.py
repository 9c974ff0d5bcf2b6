"""Reward kinds, one entry each in ``REWARD_KINDS``: what ``reward.kind`` may name.

A kind either builds a reward function of the texts (``build(settings)``: it runs in the worker
pool as responses finish, or where the rollouts are held, as the graph's ``reward_fn`` call) or
names the model role that scores them (``model``: a ``reward_inf`` inference call of that model).
``weighted`` sums named terms of the function kinds; ``none`` leaves an environment's rewards
alone. Adding a kind is one module with its builder plus one entry here. Nothing here imports
torch: the worker processes that score import this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shardflow.config.experiment import RewardConfig, RewardTermConfig
from shardflow.rl.rewards.http import http_reward
from shardflow.rl.rewards.math_answer import load_verifier, math_reward
from shardflow.rl.rewards.texts import RewardFn
from shardflow.rl.rewards.user import load_reward_function

Term = RewardConfig | RewardTermConfig  # both carry kind, function, answer_pattern and url


@dataclass(frozen=True, kw_only=True)
class RewardKind:
    summary: str
    build: Callable[[Term, float], RewardFn] | None = None  # (settings, timeout) -> a reward function of the texts
    model: str | None = None  # or the model role that scores them
    term: bool = False  # may be a term of ``weighted``
    warm: Callable[[], None] | None = None  # what a worker's warm-up does beyond building it (imports)


def _function(config: Term, timeout_s: float) -> RewardFn:
    if ":" not in config.function:
        raise ValueError(f"reward.function must look like 'module:function', got {config.function!r}")
    return load_reward_function(config.function)


REWARD_KINDS: dict[str, RewardKind] = {
    "math": RewardKind(summary="the final answer checked against data's answer with math-verify",
                       build=lambda config, timeout: math_reward(config.answer_pattern), term=True,
                       warm=load_verifier),
    "function": RewardKind(summary="reward.function, called with (prompts, responses, answers)", build=_function,
                           term=True),
    "http": RewardKind(summary="reward.url, a server of yours that the texts are posted to",
                       build=lambda config, timeout: http_reward(config.url, timeout), term=True),
    "model": RewardKind(summary="the score of models.reward, a sequence-classification model", model="reward"),
    "weighted": RewardKind(summary="the weighted sum of reward.terms"),
    "none": RewardKind(summary="no reward function: the environment's rewards alone"),
}


def reward_kind(name: str) -> RewardKind:
    if name not in REWARD_KINDS:
        raise ValueError(f"reward.kind must be one of {', '.join(REWARD_KINDS)}; got {name!r}")
    return REWARD_KINDS[name]


def reward_terms(config: RewardConfig) -> dict[str, tuple[float, RewardFn]]:
    """Name -> (weight, reward function of the texts) of the reward that ``config`` computes by
    functions; empty for a reward model or ``none``."""
    kind = reward_kind(config.kind)
    if config.kind == "weighted":
        if not config.terms:
            raise ValueError("reward.kind=weighted needs reward.terms (e.g. reward.terms.correct.kind=math)")
        out = {}
        for name, term in config.terms.items():
            if not reward_kind(term.kind).term:
                raise ValueError(f"reward.terms.{name}.kind must be a function kind, got {term.kind!r}")
            out[name] = (term.weight, REWARD_KINDS[term.kind].build(term, config.timeout_s))
        return out
    if config.terms:
        raise ValueError(f"reward.terms are summed by reward.kind=weighted, not by kind={config.kind!r}")
    if kind.build is None:
        return {}
    return {config.kind: (1.0, kind.build(config, config.timeout_s))}


def warm_up_kinds(config: RewardConfig) -> None:
    """Run the ``warm`` of each kind that ``config`` computes (in a worker, ahead of its first response)."""
    kinds = [term.kind for term in config.terms.values()] if config.kind == "weighted" else [config.kind]
    for name in kinds:
        warm = reward_kind(name).warm
        if warm is not None:
            warm()


def weighted(terms: dict[str, tuple[float, RewardFn]]) -> RewardFn:
    """One reward function: the weighted sum of ``terms``."""

    def reward(prompts: list[str], responses: list[str], answers: list[Any]) -> list[float]:
        total = [0.0] * len(responses)
        for weight, fn in terms.values():
            total = [t + weight * v for t, v in zip(total, fn(prompts, responses, answers))]
        return total

    return reward


def reward_function(config: RewardConfig) -> RewardFn:
    """The reward function of ``config`` (a kind computed by functions, not by a model)."""
    kind = reward_kind(config.kind)
    if kind.model is not None:
        raise ValueError(f"reward kind {config.kind!r} is computed by a reward model, not a function")
    return weighted(reward_terms(config))
