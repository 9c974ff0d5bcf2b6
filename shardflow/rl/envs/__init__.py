"""Multi-turn environments: what ``rollout.env`` names, made once per episode with its prompt row.

An environment is a class constructed as ``Env(row)`` (``row``: the dataset row, a dict) whose
``step(text)`` takes the model's latest turn and returns ``(observation, reward, done)`` or
``(observation, reward, done, info)``: ``observation`` is the next turn's text, or chat messages
(a list of ``{"role", "content"}``), or None when done; ``reward`` a number for this turn;
``info`` a dict of counts (``tool_calls``, ``tool_errors``) for the metrics. ``step`` may be a
coroutine function. Environments run in the worker pool (``rl.workers``), never in a rank.
The built-in ``tools`` environment (``rl.envs.tools``) runs ``rollout.tools``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from shardflow.rl.envs.tools import ToolEnv, load_tools
from shardflow.rl.user_code import load_object

BUILTIN_ENVS = {"tools": ToolEnv}


@dataclass(frozen=True)
class EnvSpec:
    """What a worker needs to make an episode's environment (picklable, from ``rollout``)."""

    env: str
    tools: tuple[str, ...] = ()
    tool_format: str = "hermes"
    role: str = "tool"


@dataclass
class Step:
    observation: str | list[dict[str, str]] | None
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


def env_class(spec: str) -> type:
    """The class ``spec`` names, checked: a built-in name or ``module:Class`` / ``file.py:Class``."""
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    if ":" not in spec:
        raise ValueError(f"rollout.env {spec!r} must be a built-in environment ({', '.join(BUILTIN_ENVS)}) or "
                         "'module:Class'")
    cls = load_object(spec, "environment")
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r} is a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "step", None)):
        raise ValueError(f"environment {spec!r} has no step(text) method")
    return cls


def check_env(spec: EnvSpec) -> None:
    """Everything about the environment that can be checked before a rank starts."""
    env_class(spec.env)
    if spec.env == "tools":
        if not spec.tools:
            raise ValueError("rollout.env=tools needs rollout.tools (e.g. [calculator])")
        load_tools(list(spec.tools))
    elif spec.tools:
        raise ValueError(f"rollout.tools are for rollout.env=tools; {spec.env!r} runs its own")


def make_env(spec: EnvSpec, row: dict) -> Any:
    cls = env_class(spec.env)
    if spec.env == "tools":
        return cls(row, tools=list(spec.tools), tool_format=spec.tool_format, role=spec.role)
    return cls(row)


def checked_step(result: Any, spec: str) -> Step:
    """An environment's ``step`` result as a ``Step``, or a clear error."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ValueError(f"environment {spec!r}: step must return (observation, reward, done[, info]), "
                         f"got {result!r:.200}")
    observation, reward, done = result[:3]
    info = result[3] if len(result) == 4 else {}
    if observation is not None and not isinstance(observation, str):
        if not (isinstance(observation, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                      for m in observation)):
            raise ValueError(f"environment {spec!r}: an observation must be text, chat messages or None, "
                             f"got {observation!r:.200}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"environment {spec!r}: the reward must be a number, got {reward!r:.100}") from None
    if not math.isfinite(reward):
        raise ValueError(f"environment {spec!r}: the reward is not finite ({reward})")
    if not isinstance(info, dict):
        raise ValueError(f"environment {spec!r}: info must be a dict, got {type(info).__name__}")
    return Step(observation, reward, bool(done) or observation is None, info)
