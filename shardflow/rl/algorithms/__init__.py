"""The RL algorithms, one entry each in ``ALGORITHMS`` (see ``base.Algorithm``).

Adding one (say RLOO) is one module here with its graph, estimator and losses, plus one entry in
the table below; ``algorithm.name`` then accepts it and ``--help-config`` lists it.
"""

from __future__ import annotations

from shardflow.rl.algorithms import grpo, ppo
from shardflow.rl.algorithms.base import Algorithm

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (grpo.GRPO, ppo.PPO)}


def algorithm_named(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    return ALGORITHMS[name]
