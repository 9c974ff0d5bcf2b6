"""Rewards of a rollout batch: the texts a reward function reads, and a reward model's scores.

A reward function takes ``(prompts, responses, answers)`` (lists of equal length: prompt text,
response text without special tokens, the dataset's reference answers) and returns one float per
response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.rl.rewards.texts import RewardFn


@dataclass
class Scores:
    rewards: torch.Tensor  # [N] float32
    errors: int = 0  # responses whose reward function raised (they got the error value)
    first_error: str = ""  # what it raised first


def score_batch(batch: SequenceBatch, tokenizer, fn: RewardFn, *, error_value: float | None = None) -> Scores:
    """The rewards of a rollout batch: decodes prompt (tokens before ``prompt_lengths``) and
    response (``loss_mask`` tokens, special tokens dropped) and reads the answers from the meta
    field ``answers``. With ``error_value``, a reward function that raises is contained: the batch
    is scored again one response at a time, and each response whose call raises gets
    ``error_value``, counted in ``errors``; without it, the error propagates."""
    if "answers" not in batch.meta:
        raise KeyError(f"the rollout batch has no meta field 'answers'; it has {sorted(batch.meta)}")
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["loss_mask"] > 0
    offsets, prompt_lengths = batch.offsets.tolist(), batch.seq_fields["prompt_lengths"].tolist()
    prompts, responses = [], []
    for i in range(len(batch)):
        start, end = offsets[i], offsets[i + 1]
        prompts.append(tokenizer.decode(ids[start:start + prompt_lengths[i]].tolist(), skip_special_tokens=True))
        responses.append(tokenizer.decode(ids[start:end][mask[start:end]].tolist(), skip_special_tokens=True))
    answers = list(batch.meta["answers"])
    if error_value is None:
        return Scores(torch.tensor(fn(prompts, responses, answers), dtype=torch.float32))
    try:
        return Scores(torch.tensor(fn(prompts, responses, answers), dtype=torch.float32))
    except Exception as e:  # noqa: BLE001 - a user's reward must not take the run down
        first = f"{type(e).__name__}: {e}"
    values, errors = [], 0
    for prompt, response, answer in zip(prompts, responses, answers):
        try:
            values.extend(fn([prompt], [response], [answer]))
        except Exception:  # noqa: BLE001 - counted and reported
            values.append(error_value)
            errors += 1
    return Scores(torch.tensor(values, dtype=torch.float32), errors, first)


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
