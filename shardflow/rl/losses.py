"""Loss terms of PPO and GRPO, their aggregation over a global batch, and the train-call losses.

Per-token terms take packed tensors ``[tokens]`` aligned as everywhere in shardflow (``x[t]`` is
about ``input_ids[t]``); ``mask`` is 1.0 on response tokens. Aggregation is *additive*: a
micro-batch's loss is its share of the loss of the whole optimizer step, so that summing the
losses (and gradients) of all micro-batches of all data-parallel replicas gives exactly the loss
of the global batch. That needs one global count, the ``normalizer``:

  token-mean            sum of masked token terms / response tokens in the step
  seq-mean-token-mean   sum over sequences of (mean over its response tokens) / sequences in the step
  seq-mean-token-sum    sum over sequences of (sum over its response tokens) / sequences in the step

``ActorLoss.normalizer`` / ``CriticLoss.normalizer`` give a batch's part of that count (the
``LossFn`` protocol of ``shardflow.engine.train.loss_fn``); the engine sums it over the DP replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardflow.config.experiment import AlgorithmConfig
from shardflow.data.batch import SequenceBatch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


# ----- per-token terms ------------------------------------------------------------------------


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                      clip_eps: float, clip_eps_high: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss per token and where the clipped branch was taken.

    loss = -min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A), r = exp(logprobs - old_logprobs);
    ``clip_eps_high`` 0 means symmetric. The second result is 1.0 where the clipped term is the
    smaller one (its gradient is zero there): the clip fraction's numerator.
    """
    high = clip_eps_high or clip_eps
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).to(logprobs.dtype)


def approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(old || new) on tokens sampled from the old policy (k3: r - 1 - log r)."""
    log_ratio = logprobs - old_logprobs
    return torch.expm1(log_ratio) - log_ratio


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) on tokens sampled from the policy (Schulman, 2020).

    With x = logprobs - ref_logprobs: k1 = x (unbiased, can be negative), k2 = x^2 / 2 (low
    variance, biased), k3 = exp(-x) - 1 + x (unbiased and never negative).
    """
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss per token and where clipping was active.

    loss = 0.5 * max((v - R)^2, (old + clip(v - old, -clip, clip) - R)^2); ``clip`` 0 gives the
    plain 0.5 * (v - R)^2. The second result is 1.0 where the clipped error is the larger one.
    """
    error = (values - returns).square()
    if clip <= 0:
        return 0.5 * error, torch.zeros_like(error)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped_error = (clipped - returns).square()
    return 0.5 * torch.maximum(error, clipped_error), (clipped_error > error).to(values.dtype)


# ----- aggregation ----------------------------------------------------------------------------


def normalizer_count(mask: torch.Tensor, lengths: torch.Tensor, mode: str) -> float:
    """This batch's part of the global normalizer of ``mode``: response tokens, or sequences that
    have at least one response token."""
    if mode == "token-mean":
        return float(mask.sum())
    _check_mode(mode)
    return float((_per_sequence_sum(mask, lengths) > 0).sum())


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, mode: str,
              normalizer: float) -> torch.Tensor:
    """This batch's share of the global loss of ``mode`` (a scalar); see the module docstring.

    ``per_token`` and ``mask`` are packed [tokens]; ``lengths`` [N] splits them into sequences.
    """
    _check_mode(mode)
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / normalizer
    per_seq = _per_sequence_sum(masked, lengths)  # [N]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / _per_sequence_sum(mask, lengths).clamp(min=1.0)
    return per_seq.sum() / normalizer


def stat_mode(mode: str) -> str:
    """How to average diagnostics (clip fraction, entropy, KL) under loss mode ``mode``: as the loss
    itself, except that token sums become token means so that a fraction stays a fraction (both
    seq-mean modes share the sequence-count normalizer, so no second count is needed)."""
    return "seq-mean-token-mean" if mode == "seq-mean-token-sum" else mode


def _per_sequence_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[tokens] -> [N] sums over each sequence's rows of the packed axis."""
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths.to(values.device))
    return values.new_zeros(len(lengths)).index_add_(0, seq, values)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


# ----- the losses handed to the training engine -----------------------------------------------


@dataclass(kw_only=True)
class ActorLoss:
    """Policy loss for ``TrainEngine.step``: clipped surrogate + KL to the reference - entropy bonus.

    Reads from the micro-batch the token fields ``logprobs`` (the generator's: the old policy),
    ``advantages``, ``loss_mask`` and ``ref_logprobs`` (needed when ``kl_coef`` > 0; when present
    the KL is reported either way); from the model outputs ``logprobs`` (new policy) and
    ``entropy``. Returns ``(loss, stats)``, every stat a detached scalar that sums over
    micro-batches and DP replicas like the loss.
    """

    clip_eps: float
    clip_eps_high: float = 0.0
    kl_coef: float = 0.0  # KL as a loss term; 0 when there is no reference or the KL is in the reward
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"

    @property
    def entropy_grad(self) -> bool:
        """Whether the engine must keep the entropy's graph (only for an entropy bonus)."""
        return self.entropy_coef > 0

    def normalizer(self, batch: SequenceBatch) -> float:
        return normalizer_count(batch.token_fields["loss_mask"], batch.lengths, self.loss_agg)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: SequenceBatch,
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        new = outputs["logprobs"]  # [tokens] float32
        fields = _fields(micro_batch, ("logprobs", "advantages", "loss_mask"), new)
        mask, lengths = fields["loss_mask"], micro_batch.lengths

        def agg(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate(per_token, mask, lengths, self.loss_agg, normalizer)

        def stat(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate(per_token.detach(), mask, lengths, stat_mode(self.loss_agg), normalizer)

        pg, clipped = clipped_surrogate(new, fields["logprobs"], fields["advantages"], clip_eps=self.clip_eps,
                                        clip_eps_high=self.clip_eps_high)
        total = pg
        stats = {"policy_loss": agg(pg.detach()), "clip_frac": stat(clipped),
                 "approx_kl": stat(approx_kl(new, fields["logprobs"]))}
        if self.kl_coef > 0 or "ref_logprobs" in micro_batch.token_fields:  # reported whenever there is a ref
            ref = _fields(micro_batch, ("ref_logprobs",), new)["ref_logprobs"]
            kl = kl_penalty(new, ref, self.kl_estimator)
            if self.kl_coef > 0:
                total = total + self.kl_coef * kl
            stats["kl"] = stat(kl)
        if "entropy" in outputs:
            stats["entropy"] = stat(outputs["entropy"])
        if self.entropy_coef > 0:
            if "entropy" not in outputs:
                raise ValueError("entropy_coef > 0 needs the engine to return 'entropy'")
            total = total - self.entropy_coef * outputs["entropy"]
        return agg(total), stats  # the engine reports the loss itself as "loss"


@dataclass(kw_only=True)
class CriticLoss:
    """Value loss for ``TrainEngine.step``: clipped squared error to the returns.

    Reads the micro-batch token fields ``values`` (the critic's at rollout: the old values),
    ``returns`` and ``loss_mask``, and the model output ``values``.
    """

    value_clip: float = 0.0
    loss_agg: str = "token-mean"
    entropy_grad = False  # a value model has no entropy

    def normalizer(self, batch: SequenceBatch) -> float:
        return normalizer_count(batch.token_fields["loss_mask"], batch.lengths, self.loss_agg)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: SequenceBatch,
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = outputs["values"]  # [tokens] float32
        fields = _fields(micro_batch, ("values", "returns", "loss_mask"), values)
        mask, lengths = fields["loss_mask"], micro_batch.lengths
        per_token, clipped = clipped_value_loss(values, fields["values"], fields["returns"], clip=self.value_clip)
        loss = aggregate(per_token, mask, lengths, self.loss_agg, normalizer)
        mode = stat_mode(self.loss_agg)
        stats = {"value_loss": loss.detach(),
                 "value_clip_frac": aggregate(clipped, mask, lengths, mode, normalizer),
                 "values": aggregate(values.detach(), mask, lengths, mode, normalizer)}
        return loss, stats


def actor_loss(algo: AlgorithmConfig, kl_coef: float) -> ActorLoss:
    """The actor loss of an ``AlgorithmConfig`` with the iteration's KL coefficient (it adapts;
    no loss term when the KL is in the reward)."""
    return ActorLoss(clip_eps=algo.clip_eps, clip_eps_high=algo.clip_eps_high,
                     kl_coef=0.0 if algo.kl.in_reward else kl_coef, kl_estimator=algo.kl.estimator,
                     entropy_coef=algo.entropy_coef, loss_agg=algo.loss_agg)


def critic_loss(algo: AlgorithmConfig, kl_coef: float = 0.0) -> CriticLoss:
    """The critic's value loss (``kl_coef`` unused: the KL is the actor's)."""
    return CriticLoss(value_clip=algo.value_clip, loss_agg=algo.loss_agg)


def _fields(batch: SequenceBatch, keys: tuple[str, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token fields moved to the outputs' device, float32 (masks become 0.0/1.0)."""
    missing = [k for k in keys if k not in batch.token_fields]
    if missing:
        raise KeyError(f"the train batch lacks token fields {missing}; it has {sorted(batch.token_fields)}")
    return {k: batch.token_fields[k].to(like.device, torch.float32) for k in keys}
