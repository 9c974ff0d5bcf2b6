"""Rewards of a rollout batch: the texts a reward function reads, and a reward model's scores.

A reward function takes ``(prompts, responses, answers)`` (lists of equal length: prompt text,
response text without special tokens, the dataset's reference answers) and returns one float per
response.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardflow.data.batch import SequenceBatch

RewardFn = Callable[[list[str], list[str], list[Any]], list[float]]


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
