"""Rewards: rule-based math verification, a user function given as ``module:function``, and the
per-sequence score of a reward model.

A reward function takes ``(prompts, responses, answers)`` (lists of equal length: prompt text,
response text without special tokens, the dataset's reference answers) and returns one float per
response. ``reward_function(config)`` builds one from a ``RewardConfig``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.config.settings import RewardConfig

RewardFn = Callable[[list[str], list[str], list[Any]], list[float]]


# ----- math ----------------------------------------------------------------------------------


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


def math_score(response: str, answer: Any, *, pattern: str = "") -> float:
    """1.0 when the response's final answer equals ``answer`` mathematically (``math-verify``),
    else 0.0 (also for a response without an answer)."""
    from math_verify import parse, verify

    # math-verify bounds its time with SIGALRM, which exists only in the main thread
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(str(answer)), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"reference answer {answer!r} cannot be read as a mathematical expression")
    extracted = extract_answer(response, pattern)
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


# ----- a user function -------------------------------------------------------------------------


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


def reward_function(config: RewardConfig) -> RewardFn:
    """The rule-based reward of ``config`` (kind math or function)."""
    if config.kind == "math":
        return math_reward(config.answer_pattern)
    if config.kind == "function":
        return load_reward_function(config.function)
    raise ValueError(f"reward kind {config.kind!r} is computed by a reward model, not a function")


# ----- batches -------------------------------------------------------------------------------


def score_batch(batch: SequenceBatch, tokenizer, fn: RewardFn) -> torch.Tensor:
    """[N] float32 rewards of a rollout batch: decodes prompt (tokens before ``prompt_lengths``)
    and response (``loss_mask`` tokens, special tokens dropped) and reads the answers from the
    meta field ``answers``."""
    if "answers" not in batch.meta:
        raise KeyError(f"the rollout batch has no meta field 'answers'; it has {sorted(batch.meta)}")
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["loss_mask"] > 0
    offsets, prompt_lengths = batch.offsets.tolist(), batch.seq_fields["prompt_lengths"].tolist()
    prompts, responses = [], []
    for i in range(len(batch)):
        start, end = offsets[i], offsets[i + 1]
        prompts.append(tokenizer.decode(ids[start:start + prompt_lengths[i]].tolist(), skip_special_tokens=True))
        responses.append(tokenizer.decode(ids[start:end][mask[start:end]].tolist(), skip_special_tokens=True))
    return torch.tensor(fn(prompts, responses, list(batch.meta["answers"])), dtype=torch.float32)


def last_token_scores(batch: SequenceBatch, scores: torch.Tensor) -> torch.Tensor:
    """[N] reward of each sequence from a reward model's packed per-position scores [tokens].

    ``scores[t]`` must be the value head applied to the hidden state at position t, which has
    read ``input_ids[: t + 1]`` (what transformers' ``...ForSequenceClassification`` pools at the
    last token), not the shifted per-token ``values`` of the critic, whose last entry has not seen
    the last token.
    """
    if scores.shape[0] != batch.num_tokens:
        raise ValueError(f"{scores.shape[0]} scores for a batch of {batch.num_tokens} tokens")
    if (batch.lengths < 1).any():
        raise ValueError("a sequence without tokens has no reward")
    return scores[batch.offsets[1:].to(scores.device) - 1].float()
