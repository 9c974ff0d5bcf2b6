"""The ``function`` reward: a user's ``module:function`` or ``file.py:function``, imported and
checked before any rank starts, its results checked on every call."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from shardflow.rl.rewards.scoring import RewardFn


def load_reward_function(spec: str) -> RewardFn:
    """Import ``package.module:function`` (or ``path/to/file.py:function``) and check that it can be
    called as ``function(prompts, responses, answers)``. Modules in the working directory are found."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must look like 'module:function'")
    if module_name.endswith(".py"):
        module = _module_from_file(module_name, spec)
    else:
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # any failure while importing the user's module is the user's error
            raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: "
                             f"{type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
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


def _module_from_file(file: str, spec: str):
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"reward function {spec!r}: file {file!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {file!r}: {type(e).__name__}: {e}") from e
    return module


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
