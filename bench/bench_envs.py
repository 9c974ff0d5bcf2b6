"""Environments and rewards for ``bench/multiturn.py`` and ``bench/reward_pool.py``, importable
by the worker processes (this directory is on their path): they take a fixed time and return
fixed answers, so that what is measured is the pool and the engine, not the user's code."""

from __future__ import annotations

import time


class SleepyEnv:
    """``row``: turns, observation_tokens, env_ms. Each step sleeps env_ms, then answers an
    observation of observation_tokens characters until the episode's last turn."""

    def __init__(self, row: dict):
        self.turns, self.chars, self.ms = int(row["turns"]), int(row["observation_tokens"]), float(row["env_ms"])
        self.done = 0

    def step(self, text: str):
        time.sleep(self.ms / 1000)
        self.done += 1
        if self.done >= self.turns:
            return None, 1.0, True
        return "x" * self.chars, 0.0, False


def sleepy_reward(prompts: list[str], responses: list[str], answers: list) -> list[float]:
    """Sleeps the number of milliseconds each answer gives, then scores 1."""
    time.sleep(sum(float(a) for a in answers) / 1000)
    return [1.0] * len(responses)


def busy_reward(prompts: list[str], responses: list[str], answers: list) -> list[float]:
    """Spins the CPU for the milliseconds each answer gives (a reward that computes, e.g. a
    verifier), then scores 1."""
    for a in answers:
        end = time.perf_counter() + float(a) / 1000
        while time.perf_counter() < end:
            pass
    return [1.0] * len(responses)
