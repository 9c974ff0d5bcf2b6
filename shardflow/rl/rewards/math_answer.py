"""The ``math`` reward: 1 when a response's final answer equals the reference mathematically.

The final answer is the last ``\\boxed{}`` (or the last match of a pattern), else the whole
response, whose last number or formula math-verify reads.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from shardflow.rl.rewards.texts import RewardFn


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def extract_answer(response: str, pattern: str = "") -> str | None:
    r"""The part of ``response`` that holds the final answer, or None when there is none.

    With ``pattern``: the first group (or the whole match) of its last match. Otherwise the last
    ``\boxed{}``, or else the whole response (the verifier then takes its last number or formula).
    """
    if pattern:
        matches = list(re.finditer(pattern, response))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if last.re.groups else last.group(0)
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    return None if "\\boxed{" in response or "\\fbox{" in response else response


# A final answer and a reference that are both plain integers are compared as integers: math-verify's
# verdict on them, without its parser (about 1.6 ms a response on a CPU core, most of a small
# model's reward time).
_INTEGER = re.compile(r"\s*-?\d{1,100}\s*")


def load_verifier() -> None:
    """Import math-verify (about a second, with sympy): a worker's warm-up does, beside the run's
    start, rather than the first response that needs it."""
    import math_verify  # noqa: F401


def math_score(response: str, answer: Any, *, pattern: str = "") -> float:
    """1.0 when the response's final answer equals ``answer`` mathematically (``math-verify``),
    else 0.0 (also for a response without an answer)."""
    extracted = extract_answer(response, pattern)
    if extracted is not None and _INTEGER.fullmatch(extracted) and _INTEGER.fullmatch(str(answer)):
        return float(int(extracted) == int(str(answer)))
    from math_verify import parse, verify

    # math-verify bounds its time with SIGALRM, which exists only in the main thread
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(str(answer)), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"reference answer {answer!r} cannot be read as a mathematical expression")
    if extracted is None or not extracted.strip():
        return 0.0
    # an extracted answer is one expression; a whole response is left to math-verify's own search
    guess = parse(extracted if extracted == response else _as_math(extracted), parsing_timeout=timeout)
    return float(bool(guess) and verify(gold, guess, timeout_seconds=timeout))


def _as_math(text: str) -> str:
    """Wrap bare LaTeX in $...$ so that math-verify's LaTeX reader takes all of it."""
    return f"${text}$" if "\\" in text and "$" not in text else text


def math_reward(pattern: str = "") -> RewardFn:
    def reward(prompts: list[str], responses: list[str], answers: list[Any]) -> list[float]:
        return [math_score(r, a, pattern=pattern) for r, a in zip(responses, answers)]

    return reward
