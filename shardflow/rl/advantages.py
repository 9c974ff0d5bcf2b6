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
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, KLConfig
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
                  kl_estimator: str = "k1", sequence_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """[N, R] per-token rewards: the sequence reward (``sequence_rewards``, default the seq field
    ``rewards``) on the last response token, minus ``kl_coef`` * KL(behaviour policy || ref) on
    every response token when ``kl_coef`` > 0."""
    scores = batch.seq_fields["rewards"] if sequence_rewards is None else sequence_rewards
    rewards = torch.zeros(len(batch), index.width)
    has = index.counts > 0
    rows = has.nonzero().squeeze(1)
    rewards[rows, index.counts[rows] - 1] = scores[rows].float()
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
                    baseline: str = "mean", eps: float = 1e-6) -> torch.Tensor:
    """Each reward [N] less a baseline from its group (the sequences sharing ``prompt_index``):
    the group's mean (GRPO; divided by the group's std + eps if ``std_normalize``), or the mean of
    the group's other rewards (``baseline="leave_one_out"``, RLOO: r_i - (sum_j r_j - r_i) / (n - 1)).
    A group whose rewards are all equal, or a group of one, gets exactly zero. In float64."""
    rewards = rewards.double()
    _, group = torch.unique(prompt_index, return_inverse=True)  # [N] group of each
    num_groups = int(group.max()) + 1 if len(group) else 0
    size = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, rewards)
    if baseline == "leave_one_out":
        n = size[group]
        centred = torch.where(n > 1, rewards - (total[group] - rewards) / (n - 1).clamp(min=1), 0.0)
    elif baseline == "mean":
        centred = rewards - (total / size)[group]
        if std_normalize:
            sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centred.square())
            std = (sq / (size - 1).clamp(min=1)).sqrt()  # unbiased, as torch.std
            centred = centred / (std[group] + eps)
    else:
        raise ValueError(f"unknown group baseline {baseline!r}; known: mean, leave_one_out")
    low = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    high = torch.full((num_groups,), -float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    flat = (low == high)[group]  # rounding in the mean must not turn equal rewards into +-1
    return torch.where(flat, 0.0, centred).float()  # [N]


def gathered_rewards(batch: SequenceBatch, group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(rewards, prompt indices) of every replica's share, in replica order, and the slice that is
    this replica's: groups split across replicas are whole again (one small all-gather)."""
    rewards, prompts = batch.seq_fields["rewards"].double().cpu(), batch.seq_fields["prompt_index"].cpu()
    if group is None:
        return rewards, prompts, slice(None)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (rewards, prompts), group=group)
    offset = sum(len(p[0]) for p in parts[: dist.get_rank(group)])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), slice(offset, offset + len(rewards))


def on_response_tokens(batch: SequenceBatch, per_sequence: torch.Tensor) -> torch.Tensor:
    """[N] values spread over each sequence's response tokens: [tokens], zero elsewhere."""
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths.cpu())
    mask = (batch.token_fields["loss_mask"].cpu() > 0).float()
    return per_sequence[seq] * mask


def group_advantages(batch: SequenceBatch, *, std_normalize: bool = True, baseline: str = "mean",
                     eps: float = 1e-6, group: ProcessGroup | None = None) -> SequenceBatch:
    """GRPO's (or RLOO's, with ``baseline="leave_one_out"``) advantages spread over each
    sequence's response tokens; ``group``: the replicas holding the rest of the batch."""
    rewards, prompts, mine = gathered_rewards(batch, group)
    advantages = group_normalize(rewards, prompts, std_normalize=std_normalize, baseline=baseline, eps=eps)[mine]
    return batch.update({"advantages": on_response_tokens(batch, advantages)})


def discounted_returns(batch: SequenceBatch, *, gamma: float, kl_coef: float = 0.0, kl_estimator: str = "k1",
                       sequence_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """[tokens] return of every response token, G_t = r_t + gamma * G_{t+1}, from the per-token
    rewards (the sequence reward at the end, the KL penalty on every token); zero elsewhere."""
    index = ResponseIndex.of(batch)
    rewards = token_rewards(batch, index, kl_coef=kl_coef, kl_estimator=kl_estimator,
                            sequence_rewards=sequence_rewards).double()  # [N, R]
    returns = torch.zeros_like(rewards)
    running = torch.zeros(len(batch), dtype=torch.float64)
    for t in reversed(range(index.width)):
        running = rewards[:, t] + gamma * running  # past the end everything is 0, so running stays 0
        returns[:, t] = running
    return index.to_packed(returns.float(), batch.num_tokens)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """(values - mean) / std over the masked entries of every replica in ``group`` (std with the
    unbiased estimator); zero outside the mask. In float64, in two passes (the mean, then the
    squared deviations from it), so a mean far from zero costs no precision."""
    mask = (mask > 0).double()
    x = values.double() * mask
    sums = torch.stack([mask.sum(), x.sum()])
    if group is not None:
        dist.all_reduce(sums, group=group)
    n, total = sums.tolist()
    if n < 2:
        raise ValueError(f"cannot whiten over {int(n)} response token(s); need at least 2")
    mean = total / n
    deviations = (((values.double() - mean) * mask).square().sum()).reshape(1)
    if group is not None:
        dist.all_reduce(deviations, group=group)
    var = float(deviations) / (n - 1)
    return ((values.double() - mean) / math.sqrt(var + eps) * mask).to(values.dtype)


# ----- the estimators ``algorithm.advantage`` names --------------------------------------------


def sequence_rewards(batch: SequenceBatch, kl_coef: float, kl_estimator: str) -> torch.Tensor:
    """[N] rewards less ``kl_coef`` x the KL summed over each response (the KL in the reward of a
    sequence-level estimator); the rewards themselves when ``kl_coef`` is 0."""
    rewards = batch.seq_fields["rewards"].double().cpu()
    if kl_coef <= 0:
        return rewards
    kl = kl_penalty(batch.token_fields["logprobs"].float(), batch.token_fields["ref_logprobs"].float(), kl_estimator)
    mask = (batch.token_fields["loss_mask"] > 0).float()
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    summed = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, seq, (kl * mask).double().cpu())
    return rewards - kl_coef * summed


def _with_rewards(batch: SequenceBatch, rewards: torch.Tensor) -> SequenceBatch:
    return batch.update(seq_fields={"rewards": rewards})


def _gae(batch, algo, kl_coef, group):
    out = gae(batch, gamma=algo.gamma, lam=algo.lam, kl_coef=kl_coef, kl_estimator=algo.kl.estimator)
    if algo.whiten_advantages:
        out = out.update({"advantages": whiten(out.token_fields["advantages"], out.token_fields["loss_mask"],
                                               group=group)})
    return out


def _grpo(batch, algo, kl_coef, group):
    return group_advantages(_with_rewards(batch, sequence_rewards(batch, kl_coef, algo.kl.estimator)),
                            std_normalize=algo.group_std_normalize, group=group)


def _rloo(batch, algo, kl_coef, group):
    return group_advantages(_with_rewards(batch, sequence_rewards(batch, kl_coef, algo.kl.estimator)),
                            baseline="leave_one_out", group=group)


def _reinforce_pp(batch, algo, kl_coef, group):
    """REINFORCE++ (Hu et al. 2025): discounted returns of the per-token rewards (the KL in them),
    whitened over the whole batch."""
    returns = discounted_returns(batch, gamma=algo.gamma, kl_coef=kl_coef, kl_estimator=algo.kl.estimator)
    return batch.update({"advantages": whiten(returns, batch.token_fields["loss_mask"], group=group)})


def _reinforce_pp_baseline(batch, algo, kl_coef, group):
    """REINFORCE++-baseline: each reward less its group's mean, then as REINFORCE++."""
    rewards, prompts, mine = gathered_rewards(batch, group)
    centred = group_normalize(rewards, prompts, std_normalize=False)[mine]
    returns = discounted_returns(batch, gamma=algo.gamma, kl_coef=kl_coef, kl_estimator=algo.kl.estimator,
                                 sequence_rewards=centred)
    return batch.update({"advantages": whiten(returns, batch.token_fields["loss_mask"], group=group)})


def _remax(batch, algo, kl_coef, group):
    """ReMax (Li et al. 2024): the returns of the per-token rewards less the reward of the greedy
    response to the same prompt (the seq field ``baseline_rewards``), not whitened."""
    returns = discounted_returns(batch, gamma=algo.gamma, kl_coef=kl_coef, kl_estimator=algo.kl.estimator)
    baseline = on_response_tokens(batch, batch.seq_fields["baseline_rewards"].float().cpu())
    return batch.update({"advantages": returns - baseline})


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator:
    compute: Callable[[SequenceBatch, AlgorithmConfig, float, "ProcessGroup | None"], SequenceBatch]
    knobs: tuple[str, ...] = ()  # the algorithm settings it reads
    needs: str = ""  # what the graph must provide besides rewards: "values" (a critic), "baseline_rewards"
    groups: bool = False  # compares the samples of a prompt: needs several


ADVANTAGES: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(compute=_gae, knobs=("gamma", "lam", "whiten_advantages", "value_clip"), needs="values"),
    "grpo": AdvantageEstimator(compute=_grpo, knobs=("group_std_normalize",), groups=True),
    "rloo": AdvantageEstimator(compute=_rloo, groups=True),
    "reinforce_pp": AdvantageEstimator(compute=_reinforce_pp, knobs=("gamma",)),
    "reinforce_pp_baseline": AdvantageEstimator(compute=_reinforce_pp_baseline, knobs=("gamma",), groups=True),
    "remax": AdvantageEstimator(compute=_remax, knobs=("gamma",), needs="baseline_rewards"),
}


def compute_advantages(batch: SequenceBatch, algo: AlgorithmConfig, *, kl_coef: float = 0.0,
                       group: ProcessGroup | None = None) -> SequenceBatch:
    """The share with ``advantages`` (and ``returns`` for GAE) by resolved ``algo.advantage``;
    ``kl_coef`` is the iteration's KL coefficient, used here when the KL is in the reward;
    ``group``: the data-parallel replicas holding the rest of the batch (None: this is all of it)."""
    if algo.advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {algo.advantage!r}; known: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[algo.advantage].compute(batch, algo, kl_coef if algo.kl.in_reward else 0.0, group)


# ----- KL coefficient -------------------------------------------------------------------------


def sequence_kl(batch: SequenceBatch, group: ProcessGroup | None = None) -> float:
    """Mean over sequences of the summed per-token log(pi / ref) of the sampled responses (the
    generator's log-probabilities against the reference's): the KL per sample that the adaptive
    controller tracks (Ziegler et al. 2019). ``group``: the replicas holding the rest of the batch."""
    mask = (batch.token_fields["loss_mask"] > 0).double()
    diff = (batch.token_fields["logprobs"].double() - batch.token_fields["ref_logprobs"].double()) * mask
    sums = torch.stack([diff.sum(), torch.tensor(float(len(batch)), dtype=torch.float64)])
    if group is not None:
        dist.all_reduce(sums, group=group)
    total, count = sums.tolist()
    return total / max(count, 1.0)


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
