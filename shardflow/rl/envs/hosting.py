"""The episodes a worker process holds: made, stepped and closed by tasks from the rank
(``rl.envs.client``), keyed by the rank's episode key. A worker that restarts has lost them."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from shardflow.rl.envs import EnvSpec, Step, checked_step, make_env

_EPISODES: dict[Any, tuple[EnvSpec, Any]] = {}
_LOOP: asyncio.AbstractEventLoop | None = None


def open_episode(key: Any, spec: EnvSpec, row: dict) -> None:
    _EPISODES[key] = (spec, make_env(spec, row))


def step_episode(key: Any, text: str) -> Step:
    global _LOOP
    if key not in _EPISODES:
        raise RuntimeError(f"episode {key!r} is not open in this worker (its worker was restarted)")
    spec, env = _EPISODES[key]
    result = env.step(text)
    if inspect.isawaitable(result):
        _LOOP = _LOOP or asyncio.new_event_loop()
        result = _LOOP.run_until_complete(result)
    return checked_step(result, spec.env)


def close_episode(key: Any) -> None:
    spec_env = _EPISODES.pop(key, None)
    close = getattr(spec_env[1], "close", None) if spec_env else None
    if callable(close):
        close()
