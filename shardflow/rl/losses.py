"""Loss terms of PPO and GRPO, their aggregation over a global batch, and the train-call losses.

Per-token terms take packed tensors ``[tokens]`` aligned as everywhere in shardflow (``x[t]`` is
about ``input_ids[t]``); ``mask`` is 1.0 on response tokens. Aggregation is *additive*: a
micro-batch's loss is its share of the loss of the whole optimizer step, so that summing the
losses (and gradients) of all micro-batches of all data-parallel replicas gives exactly the loss
of the global batch. That needs one global count, the ``normalizer``:

  token-mean               sum of masked token terms / response tokens in the step
  seq-mean-token-mean      sum over sequences of (mean over its response tokens) / sequences in the step
  seq-mean-token-sum       sum over sequences of (sum over its response tokens) / sequences in the step
  seq-mean-token-sum-norm  as seq-mean-token-sum, each sum divided by one constant length (the
                           generation limit) instead of its own (Dr. GRPO: no length bias)

``ActorLoss.normalizer`` / ``CriticLoss.normalizer`` give a batch's part of that count (the
``LossFn`` protocol of ``shardflow.engine.train.loss_fn``); the engine sums it over the DP replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardflow.config.experiment import KL_ESTIMATORS, LOSS_AGG_MODES, AlgorithmConfig
from shardflow.data.batch import SequenceBatch

# ----- per-token terms ------------------------------------------------------------------------


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                      clip_low: float, clip_high: float | None = None,
                      dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss per token and where the clipped branch was taken.

    loss = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), r = exp(logprobs - old_logprobs);
    ``clip_high`` None means ``clip_low`` (DAPO's clip-higher sets it larger). With ``dual_clip``
    c > 1 (Ye et al. 2020), the loss of a negative advantage is at most -c * A, however large r
    grows. The second result is 1.0 where a clipped term bounds the loss (its gradient is zero
    there): the clip fraction's numerator.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    return _clipped(ratio, advantages, clip_low, clip_low if clip_high is None else clip_high, dual_clip)


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float,
             dual_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - low, 1.0 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    bounded = (clipped > unclipped).to(ratio.dtype)
    if dual_clip > 0:
        cap = -dual_clip * advantages  # only binds where A < 0
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        bounded = torch.where(capped, torch.ones_like(bounded), bounded)
    return loss, bounded


def sequence_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, lengths: torch.Tensor, *, clip_low: float,
                       clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO's clipped loss (Zheng et al. 2025) per token: the importance ratio of a sequence is
    the geometric mean of its tokens' ratios, s = exp(mean over its response tokens of
    (logprobs - old_logprobs)), clipped per sequence. Each token carries s with the gradient of its
    own log-probability (s_t = sg(s) * exp(logp_t - sg(logp_t)): the value s, the gradient
    s * d logp_t), so that a sequence-mean aggregation gives GSPO's gradient exactly."""
    log_ratio = (logprobs - old_logprobs) * mask
    counts = _per_sequence_sum(mask, lengths).clamp(min=1.0)
    seq_log_ratio = _per_sequence_sum(log_ratio, lengths) / counts  # [N]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=logprobs.device), lengths.to(logprobs.device))
    ratio = torch.exp(seq_log_ratio.detach()[seq] + logprobs - logprobs.detach())  # [tokens]
    return _clipped(ratio, advantages, clip_low, clip_low if clip_high is None else clip_high, 0.0)


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
              normalizer: float, norm_length: float = 1.0) -> torch.Tensor:
    """This batch's share of the global loss of ``mode`` (a scalar); see the module docstring.

    ``per_token`` and ``mask`` are packed [tokens]; ``lengths`` [N] splits them into sequences;
    ``norm_length``: seq-mean-token-sum-norm's constant length.
    """
    _check_mode(mode)
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / normalizer
    per_seq = _per_sequence_sum(masked, lengths)  # [N]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / _per_sequence_sum(mask, lengths).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / norm_length
    return per_seq.sum() / normalizer


def stat_mode(mode: str) -> str:
    """How to average diagnostics (clip fraction, entropy, KL) under loss mode ``mode``: as the loss
    itself, except that token sums become token means so that a fraction stays a fraction (both
    seq-mean modes share the sequence-count normalizer, so no second count is needed)."""
    return "seq-mean-token-mean" if mode.startswith("seq-mean-token-sum") else mode


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
    """Policy loss for ``TrainEngine.step``: the policy loss (PPO's clipped surrogate per token,
    or GSPO's per sequence) + KL to the reference - entropy bonus.

    Reads from the micro-batch the token fields ``logprobs`` (the generator's: the old policy),
    ``advantages``, ``loss_mask`` and ``ref_logprobs`` (needed when ``kl_coef`` > 0; when present
    the KL is reported either way); from the model outputs ``logprobs`` (new policy) and
    ``entropy``. Returns ``(loss, stats)``, every stat a detached scalar that sums over
    micro-batches and DP replicas like the loss.
    """

    policy_loss: str = "ppo_clip"  # or "gspo"
    clip_low: float = 0.2
    clip_high: float | None = None  # None: clip_low
    dual_clip: float = 0.0  # ppo_clip only; 0: off
    kl_coef: float = 0.0  # KL as a loss term; 0 when there is no reference or the KL is in the reward
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    norm_length: float = 1.0  # seq-mean-token-sum-norm's constant length (the generation limit)

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {self.policy_loss!r}; known: {', '.join(POLICY_LOSSES)}")
        _check_mode(self.loss_agg)

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
            return aggregate(per_token, mask, lengths, self.loss_agg, normalizer, self.norm_length)

        def stat(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate(per_token.detach(), mask, lengths, stat_mode(self.loss_agg), normalizer)

        if self.policy_loss == "gspo":
            pg, clipped = sequence_surrogate(new, fields["logprobs"], fields["advantages"], mask, lengths,
                                             clip_low=self.clip_low, clip_high=self.clip_high)
        else:
            pg, clipped = clipped_surrogate(new, fields["logprobs"], fields["advantages"], clip_low=self.clip_low,
                                            clip_high=self.clip_high, dual_clip=self.dual_clip)
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
class LikelihoodLoss:
    """Weighted log-likelihood for ``TrainEngine.step``: -sum_t A_t log pi(token_t), aggregated.

    With A = 1 on a response's tokens it is supervised fine-tuning's loss; with DPO's per-pair
    weights (``rl.algorithms.dpo``) its gradient is DPO's. Reads the token fields ``advantages``
    and ``loss_mask``, and the model output ``logprobs``.
    """

    loss_agg: str = "token-mean"
    entropy_grad = False  # no entropy bonus

    def normalizer(self, batch: SequenceBatch) -> float:
        return normalizer_count(batch.token_fields["loss_mask"], batch.lengths, self.loss_agg)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: SequenceBatch,
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        new = outputs["logprobs"]  # [tokens] float32
        fields = _fields(micro_batch, ("advantages", "loss_mask"), new)
        mask, lengths = fields["loss_mask"], micro_batch.lengths
        loss = aggregate(-fields["advantages"] * new, mask, lengths, self.loss_agg, normalizer)
        stats = {"nll": aggregate(-new.detach(), mask, lengths, stat_mode(self.loss_agg), normalizer)}
        if "entropy" in outputs:
            stats["entropy"] = aggregate(outputs["entropy"], mask, lengths, stat_mode(self.loss_agg), normalizer)
        return loss, stats


def likelihood_loss(algo: AlgorithmConfig, kl_coef: float = 0.0, *, norm_length: float = 1.0) -> LikelihoodLoss:
    return LikelihoodLoss(loss_agg=algo.loss_agg)


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


# the policy losses ``algorithm.policy_loss`` names, with the algorithm settings each reads
POLICY_LOSSES: dict[str, tuple[str, ...]] = {
    "ppo_clip": ("clip_low", "clip_high", "dual_clip"),
    "gspo": ("clip_low", "clip_high"),
}


def actor_loss(algo: AlgorithmConfig, kl_coef: float, *, norm_length: float = 1.0) -> ActorLoss:
    """The actor loss of resolved algorithm settings (``rl.algorithms``) with the iteration's KL
    coefficient (it adapts; no loss term when the KL is in the reward)."""
    return ActorLoss(policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
                     dual_clip=algo.dual_clip or 0.0, kl_coef=0.0 if algo.kl.in_reward else kl_coef,
                     kl_estimator=algo.kl.estimator, entropy_coef=algo.entropy_coef, loss_agg=algo.loss_agg,
                     norm_length=norm_length)


def critic_loss(algo: AlgorithmConfig, kl_coef: float = 0.0, *, norm_length: float = 1.0) -> CriticLoss:
    """The critic's value loss (``kl_coef`` unused: the KL is the actor's)."""
    return CriticLoss(value_clip=algo.value_clip or 0.0,
                      loss_agg="token-mean" if algo.loss_agg == "seq-mean-token-sum-norm" else algo.loss_agg)


def _fields(batch: SequenceBatch, keys: tuple[str, ...], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token fields moved to the outputs' device, float32 (masks become 0.0/1.0)."""
    missing = [k for k in keys if k not in batch.token_fields]
    if missing:
        raise KeyError(f"the train batch lacks token fields {missing}; it has {sorted(batch.token_fields)}")
    return {k: batch.token_fields[k].to(like.device, torch.float32) for k in keys}
