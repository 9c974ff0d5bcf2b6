"""Rewards scored in the worker pool as each response finishes, beside decoding.

``PooledRewards`` (the rank's side) sends one task per finished response; ``score_texts`` (the
worker's side) computes every term of the reward for it. A response whose scoring raises or
times out gets ``reward.error_value``, counted, with the first error kept for the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shardflow.config.experiment import RewardConfig
from shardflow.rl.rewards import reward_terms, warm_up_kinds
from shardflow.rl.workers import WorkerPool

CHANNEL = "rewards"
WARM_UP_CHANNEL = "rewards/warm-up"
_TERMS: dict[str, dict] = {}  # in a worker: the built terms of each reward config, by its repr


def _terms(config: RewardConfig) -> dict:
    key = repr(config)
    if key not in _TERMS:
        _TERMS[key] = reward_terms(config)
    return _TERMS[key]


def score_texts(config: RewardConfig, prompt: str, response: str, answer: Any) -> dict[str, float]:
    """Every term's reward of one response (runs in a worker)."""
    return {name: float(fn([prompt], [response], [answer])[0]) for name, (_, fn) in _terms(config).items()}


def prepare_terms(config: RewardConfig) -> None:
    """Build the reward's terms (importing the users' modules) and warm their kinds up ahead of the
    first response (runs in a worker)."""
    _terms(config)
    warm_up_kinds(config)


def warm_up(pool: WorkerPool, config: RewardConfig) -> None:
    """Start the pool's workers and have each build the reward's terms now, beside the run's own
    start, instead of when the first responses finish. Nothing collects these tasks: a term that
    fails to build fails again, and is counted, when it scores."""
    pool.start()
    for worker in range(pool.size):
        pool.call(WARM_UP_CHANNEL, worker, "shardflow.rl.rewards.pooled:prepare_terms", config,
                  timeout_s=config.timeout_s, home=worker)


@dataclass
class PooledScores:
    rewards: dict[Any, float]  # key -> the weighted total
    terms: dict[str, list[float]]  # term -> its values over the scored responses (errors left out)
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0  # in the workers
    waited: float = 0.0  # that the rank waited for them after submitting the last one


@dataclass
class PooledRewards:
    pool: WorkerPool
    config: RewardConfig
    weights: dict[str, float] = field(init=False)
    _submitted: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.weights = {name: weight for name, (weight, _) in reward_terms(self.config).items()}

    def submit(self, key: Any, prompt: str, response: str, answer: Any) -> None:
        self._submitted += 1
        self.pool.call(CHANNEL, key, "shardflow.rl.rewards.pooled:score_texts", self.config, prompt, response,
                       answer, timeout_s=self.config.timeout_s)

    def collect(self) -> PooledScores:
        """Wait for every submitted response's reward."""
        start = time.perf_counter()
        results = []
        while len(results) < self._submitted:
            results += self.pool.results(CHANNEL, wait=True, timeout=1.0)
        waited = time.perf_counter() - start
        self._submitted = 0
        out = PooledScores({}, {name: [] for name in self.weights}, waited=waited)
        for r in results:
            out.seconds += r.seconds
            if not r.ok:
                out.rewards[r.key] = self.config.error_value
                out.errors += 1
                out.first_error = out.first_error or str(r.value)
                continue
            out.rewards[r.key] = sum(self.weights[name] * value for name, value in r.value.items())
            for name, value in r.value.items():
                out.terms[name].append(value)
        return out
