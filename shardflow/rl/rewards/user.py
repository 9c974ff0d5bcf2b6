"""The ``function`` reward: a user's ``module:function`` or ``file.py:function``, imported and
checked before any rank starts, its results checked on every call."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

from shardflow.rl.rewards.texts import RewardFn
from shardflow.rl.user_code import load_object


def load_reward_function(spec: str) -> RewardFn:
    """Import ``package.module:function`` (or ``path/to/file.py:function``) and check that it can be
    called as ``function(prompts, responses, answers)``. Modules in the working directory are found."""
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r} must look like 'module:function'")
    fn = load_object(spec, "reward function")
    attr = spec.rpartition(":")[2]
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as e:
        raise ValueError(f"reward function {spec!r} must accept (prompts, responses, answers); "
                         f"its signature is {attr}{inspect.signature(fn)}: {e}") from None
    except ValueError:  # builtins without a signature: checked when called
        pass
    return _checked(fn, spec)


def _checked(fn: Callable, spec: str) -> RewardFn:
    """``fn`` with its results checked: one finite number per response."""

    def reward(prompts: list[str], responses: list[str], answers: list[Any]) -> list[float]:
        out = fn(prompts, responses, answers)
        try:
            values = [float(x) for x in out]
        except (TypeError, ValueError):
            raise ValueError(f"reward function {spec!r} must return a list of numbers, got {out!r:.200}") from None
        if len(values) != len(responses):
            raise ValueError(f"reward function {spec!r} returned {len(values)} rewards for {len(responses)} responses")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reward function {spec!r} returned a non-finite reward for response {bad[0]}: "
                             f"{values[bad[0]]}")
        return values

    return reward
