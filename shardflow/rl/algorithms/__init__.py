"""The RL algorithms, one entry each in ``ALGORITHMS`` (see ``base.Algorithm``).

Adding one is one module here with its graph and its preset of the algorithm knobs (and, where
the shared ones do not do, its estimator in ``rl.advantages`` or its loss in ``rl.losses``), plus
one entry in the table below; ``algorithm.name`` then accepts it and ``--help-config`` lists it.
"""

from __future__ import annotations

from shardflow.rl.algorithms import dapo, dpo, grpo, gspo, ppo, reinforce_pp, remax, rloo, sft
from shardflow.rl.algorithms.base import Algorithm

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    ppo.PPO, grpo.GRPO, grpo.DR_GRPO, rloo.RLOO, reinforce_pp.REINFORCE_PP, reinforce_pp.REINFORCE_PP_BASELINE,
    remax.REMAX, gspo.GSPO, dapo.DAPO, sft.SFT, dpo.DPO)}


def algorithm_named(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    return ALGORITHMS[name]


def preset_text(algorithm: Algorithm) -> str:
    """``knob=value, ...`` of an algorithm's preset (a value computed from the settings: its
    docstring's first line)."""
    def shown(value) -> str:
        return value.__doc__.strip().splitlines()[0] if callable(value) else str(value)

    return ", ".join(f"{knob}={shown(value)}" for knob, value in algorithm.preset.items())


def algorithm_table() -> list[str]:
    """One line per algorithm: its name, what it is and what it sets (for --help-config)."""
    return [f"{a.name}: {a.summary}; {'online' if a.online else 'offline'}; sets {preset_text(a)}"
            for a in ALGORITHMS.values()]
