"""Advantages (and returns) from an iteration's rollouts, one estimator per algorithm.

Every estimator takes one data-parallel replica's share of the iteration batch and the process
group of the replicas (None when the share is the whole batch) and returns the share with token
fields ``advantages`` (and ``returns`` where a critic is trained), zero outside ``loss_mask``.
What needs the whole batch is exchanged over that group, and it is small: GRPO gathers one
(prompt, reward) pair per sequence to see complete groups; whitening all-reduces three sums.
Each algorithm (``rl.algorithms``) builds its estimator from these pieces.

Rewards live in the seq field ``rewards`` (one scalar per sequence); per-token fields follow the
shared alignment: ``values[t]`` is the value of the state before response token ``t``. The batch
is expected on the CPU (the work is a few vector operations per response position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardflow.config.experiment import KLConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.losses import kl_penalty

# ----- response tokens as a left-aligned [N, R] matrix ----------------------------------------


@dataclass(frozen=True)
class ResponseIndex:
    """Where each response token (``loss_mask`` > 0) of a packed batch sits in a left-aligned
    [N, R] matrix (row = sequence, column = rank among that sequence's response tokens)."""

    token: torch.Tensor  # [M] packed rows of the response tokens
    row: torch.Tensor  # [M] sequence of each
    col: torch.Tensor  # [M] column of each
    counts: torch.Tensor  # [N] response tokens per sequence
    width: int  # R = max(counts)

    @classmethod
    def of(cls, batch: SequenceBatch) -> "ResponseIndex":
        mask = batch.token_fields["loss_mask"] > 0  # [tokens]
        seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)  # [tokens]
        counts = torch.zeros(len(batch), dtype=torch.long).index_add_(0, seq, mask.long())
        before = counts.cumsum(0) - counts  # response tokens in earlier sequences
        col = mask.long().cumsum(0) - 1 - before[seq]
        token = mask.nonzero().squeeze(1)
        return cls(token, seq[token], col[token], counts, int(counts.max()) if len(counts) else 0)

    def to_matrix(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [N, R] float32, zero after each sequence's last response token."""
        out = torch.zeros(len(self.counts), self.width)
        out[self.row, self.col] = packed[self.token].float()
        return out

    def to_packed(self, matrix: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[N, R] -> [tokens], zero outside the response tokens."""
        out = torch.zeros(num_tokens)
        out[self.token] = matrix[self.row, self.col]
        return out


# ----- estimators -----------------------------------------------------------------------------


def token_rewards(batch: SequenceBatch, index: ResponseIndex, *, kl_coef: float = 0.0,
                  kl_estimator: str = "k1") -> torch.Tensor:
    """[N, R] per-token rewards: the sequence reward on the last response token, minus
    ``kl_coef`` * KL(behaviour policy || ref) on every response token when ``kl_coef`` > 0."""
    rewards = torch.zeros(len(batch), index.width)
    has = index.counts > 0
    rows = has.nonzero().squeeze(1)
    rewards[rows, index.counts[rows] - 1] = batch.seq_fields["rewards"][rows].float()
    if kl_coef > 0:
        kl = kl_penalty(batch.token_fields["logprobs"].float(), batch.token_fields["ref_logprobs"].float(),
                        kl_estimator)
        rewards = rewards - kl_coef * index.to_matrix(kl)
    return rewards


def gae(batch: SequenceBatch, *, gamma: float, lam: float, kl_coef: float = 0.0,
        kl_estimator: str = "k1") -> SequenceBatch:
    """Generalised advantage estimation over each sequence's response tokens (Schulman et al. 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, returns = A + V,
    with V after the last response token taken as 0 (the episode ends there).
    """
    index = ResponseIndex.of(batch)
    rewards = token_rewards(batch, index, kl_coef=kl_coef, kl_estimator=kl_estimator)  # [N, R]
    values = index.to_matrix(batch.token_fields["values"])  # [N, R], 0 past the end
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(len(batch))
    running = torch.zeros(len(batch))
    for t in reversed(range(index.width)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running  # past the end everything is 0, so running stays 0
        advantages[:, t] = running
        next_value = values[:, t]
    returns = advantages + values
    n = batch.num_tokens
    return batch.update({"advantages": index.to_packed(advantages, n), "returns": index.to_packed(returns, n)})


def group_normalize(rewards: torch.Tensor, prompt_index: torch.Tensor, *, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward [N] centred on the mean of its group (sequences sharing ``prompt_index``),
    divided by the group's std + eps if asked. A group whose rewards are all equal (or a group of
    one) gets exactly zero."""
    rewards = rewards.double()  # float64 so the group sums are exact enough
    _, group = torch.unique(prompt_index, return_inverse=True)  # [N] group of each
    num_groups = int(group.max()) + 1 if len(group) else 0
    size = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, rewards) / size
    centred = rewards - mean[group]
    if std_normalize:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centred.square())
        std = (sq / (size - 1).clamp(min=1)).sqrt()  # unbiased, as torch.std
        centred = centred / (std[group] + eps)
    low = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    high = torch.full((num_groups,), -float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    flat = (low == high)[group]  # rounding in the mean must not turn equal rewards into +-1
    return torch.where(flat, 0.0, centred).float()  # [N]


def group_advantages(batch: SequenceBatch, *, std_normalize: bool = True, eps: float = 1e-6,
                     group: ProcessGroup | None = None) -> SequenceBatch:
    """GRPO advantages spread over each sequence's response tokens. With ``group``, the other
    replicas' (prompt, reward) pairs are gathered first, so groups split across replicas are whole."""
    rewards, prompts = batch.seq_fields["rewards"].float().cpu(), batch.seq_fields["prompt_index"].cpu()
    mine = slice(None)
    if group is not None:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (rewards, prompts), group=group)
        offset = sum(len(p[0]) for p in parts[: dist.get_rank(group)])
        mine = slice(offset, offset + len(rewards))
        rewards, prompts = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    advantages = group_normalize(rewards, prompts, std_normalize=std_normalize, eps=eps)[mine]  # [N]
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths.cpu())
    mask = (batch.token_fields["loss_mask"].cpu() > 0).float()
    return batch.update({"advantages": advantages[seq] * mask})  # [tokens]


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """(values - mean) / std over the masked entries of every replica in ``group`` (std with the
    unbiased estimator); zero outside the mask."""
    mask = (mask > 0).float()
    sums = torch.stack([mask.sum(), (values * mask).sum(), (values.square() * mask).sum()]).double()
    if group is not None:
        dist.all_reduce(sums, group=group)
    n, total, total_sq = sums.tolist()
    if n < 2:
        raise ValueError(f"cannot whiten over {int(n)} response token(s); need at least 2")
    mean = total / n
    var = max(total_sq - n * mean * mean, 0.0) / (n - 1)
    return (values - mean) * (1.0 / math.sqrt(var + eps)) * mask


# ----- KL coefficient -------------------------------------------------------------------------


def sequence_kl(batch: SequenceBatch) -> float:
    """Mean over sequences of the summed per-token log(pi / ref) of the sampled responses: the
    KL per sample that the adaptive controller tracks."""
    mask = (batch.token_fields["loss_mask"] > 0).float()
    diff = (batch.token_fields["logprobs"].float() - batch.token_fields["ref_logprobs"].float()) * mask
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    return float(torch.zeros(len(batch)).index_add_(0, seq, diff).mean())


@dataclass(kw_only=True)
class KLController:
    """KL coefficient, fixed (``target`` 0) or adaptive as in Ziegler et al. 2019: after each
    iteration, value *= 1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon."""

    value: float
    target: float = 0.0
    horizon: int = 10000

    @classmethod
    def from_config(cls, kl: KLConfig) -> "KLController":
        return cls(value=kl.coef, target=kl.target, horizon=kl.horizon)

    def update(self, kl: float, num_samples: int) -> None:
        if self.target <= 0:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
