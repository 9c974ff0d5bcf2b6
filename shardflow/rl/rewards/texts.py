"""The shape of a reward function of texts (what reward functions, terms and servers compute)."""

from __future__ import annotations

from typing import Any, Callable

# (prompts, responses, answers) -> one float per response
RewardFn = Callable[[list[str], list[str], list[Any]], list[float]]
