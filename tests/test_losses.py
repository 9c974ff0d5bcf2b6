"""PPO/GRPO loss terms against hand-computed values, and aggregation that is exact across any split
of the global batch into DP replicas and micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from shardflow.config.experiment import AlgorithmConfig, KLConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.losses import (
    ActorLoss,
    CriticLoss,
    actor_loss,
    aggregate,
    approx_kl,
    clipped_surrogate,
    clipped_value_loss,
    kl_penalty,
    normalizer_count,
    sequence_surrogate,
)

LN2 = math.log(2.0)


def test_clipped_surrogate_by_hand():
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_surrogate(ratio.log(), torch.zeros(5), adv, clip_low=0.2)
    # -min(rA, clip(r, 0.8, 1.2) A): 1*1 | 1.2 (clipped) | 0.5 | -1.5 | -0.8 (clipped)
    assert torch.allclose(loss, torch.tensor([-1.0, -1.2, -0.5, 1.5, 0.8]))
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    # asymmetric: the upper bound moves to 1.28, the lower stays at 0.8
    loss, clipped = clipped_surrogate(ratio.log(), torch.zeros(5), adv, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([-1.0, -1.28, -0.5, 1.5, 0.8]))
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]


def test_approx_kl_and_kl_estimators_by_hand():
    # ratio 2: r - 1 - log r
    assert approx_kl(torch.tensor([LN2]), torch.tensor([0.0])).item() == pytest.approx(1 - LN2)
    # pi = 0.5, ref = 0.25 -> x = log 2
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(LN2)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * LN2 ** 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_kl():
    # tokens sampled from pi: the mean of k1 and k3 tends to KL(pi || ref) = sum pi log(pi / ref)
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    exact = float((pi * (pi / ref).log()).sum())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    lp, lref = pi.log()[tokens], ref.log()[tokens]
    # standard error of the mean is below 0.002 for both at this sample size
    assert kl_penalty(lp, lref, "k1").mean().item() == pytest.approx(exact, abs=0.01)
    assert kl_penalty(lp, lref, "k3").mean().item() == pytest.approx(exact, abs=0.01)
    assert (kl_penalty(lp, lref, "k3") >= 0).all()


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 3.0])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # token 0: (1-0)^2 = 1 vs (0.7-0)^2 = 0.49 -> 0.5; token 1: (2-3)^2 = 1 vs (0.7-3)^2 = 5.29 -> 2.645
    assert torch.allclose(loss, torch.tensor([0.5, 2.645]))
    assert clipped.tolist() == [0.0, 1.0]
    loss, _ = clipped_value_loss(values, old, returns, clip=0.0)
    assert torch.allclose(loss, torch.tensor([0.5, 0.5]))


def test_aggregation_modes_by_hand():
    # three sequences of 3, 2, 4 tokens; response tokens where mask is 1
    per_token = torch.tensor([9.0, 1.0, 2.0, 9.0, 4.0, 9.0, 1.0, 1.0, 7.0])
    mask = torch.tensor([0.0, 1, 1, 0, 1, 0, 1, 1, 1])
    lengths = torch.tensor([3, 2, 4])
    # token-mean: (1 + 2 + 4 + 1 + 1 + 7) / 6
    assert normalizer_count(mask, lengths, "token-mean") == 6
    assert aggregate(per_token, mask, lengths, "token-mean", 6).item() == pytest.approx(16 / 6)
    # seq-mean-token-mean: (1.5 + 4 + 3) / 3
    assert normalizer_count(mask, lengths, "seq-mean-token-mean") == 3
    assert aggregate(per_token, mask, lengths, "seq-mean-token-mean", 3).item() == pytest.approx(8.5 / 3)
    # seq-mean-token-sum: (3 + 4 + 9) / 3
    assert aggregate(per_token, mask, lengths, "seq-mean-token-sum", 3).item() == pytest.approx(16 / 3)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(per_token, mask, lengths, "mean", 1)


def _rollouts(n: int, seed: int) -> SequenceBatch:
    """Random sequences with prompt and response parts and every field the actor loss reads."""
    gen = torch.Generator().manual_seed(seed)
    seqs = {k: [] for k in ("logprobs", "ref_logprobs", "advantages", "loss_mask")}
    for _ in range(n):
        prompt, response = torch.randint(1, 4, (2,), generator=gen).tolist()
        length = prompt + response
        seqs["logprobs"].append(-torch.rand(length, generator=gen) * 2)
        seqs["ref_logprobs"].append(-torch.rand(length, generator=gen) * 2)
        seqs["advantages"].append(torch.randn(length, generator=gen))
        seqs["loss_mask"].append(torch.cat([torch.zeros(prompt), torch.ones(response)]))
    return SequenceBatch.from_lists(range(n), seqs)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_actor_loss_is_exact_across_replicas_and_micro_batches(mode, policy_loss):
    batch = _rollouts(7, seed=1)
    gen = torch.Generator().manual_seed(2)
    new_full = (batch.token_fields["logprobs"] + 0.3 * torch.randn(batch.num_tokens, generator=gen)).requires_grad_()
    entropy = torch.rand(batch.num_tokens, generator=gen)
    loss_fn = ActorLoss(policy_loss=policy_loss, clip_low=0.2, clip_high=0.3, kl_coef=0.1, kl_estimator="k3",
                        entropy_coef=0.01, loss_agg=mode, norm_length=16.0,
                        dual_clip=3.0 if policy_loss == "ppo_clip" else 0.0)

    # the whole batch at once
    loss, stats = loss_fn({"logprobs": new_full, "entropy": entropy}, batch, loss_fn.normalizer(batch))
    loss.backward()
    grad_full = new_full.grad.clone()
    new_full.grad = None

    # two DP replicas holding 4 and 3 sequences, each split into micro-batches; the normalizer is
    # the count summed over every micro-batch of every replica
    replicas = [[[3, 0], [5]], [[6, 1, 2], [4]]]
    micro_batches = [batch.select(ids) for replica in replicas for ids in replica]
    normalizer = sum(loss_fn.normalizer(mb) for mb in micro_batches)
    assert normalizer == loss_fn.normalizer(batch)
    rows = [torch.arange(int(batch.offsets[i]), int(batch.offsets[i + 1])) for i in range(len(batch))]
    total, summed = 0.0, {k: 0.0 for k in stats}
    for ids in [ids for replica in replicas for ids in replica]:
        index = torch.cat([rows[i] for i in ids])
        part_loss, part_stats = loss_fn({"logprobs": new_full[index], "entropy": entropy[index]},
                                        batch.select(ids), normalizer)
        part_loss.backward()
        total += part_loss.item()
        summed = {k: summed[k] + part_stats[k].item() for k in stats}
    # float32 sums in a different order: agreement to ~1e-6 relative
    assert total == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    for k in stats:
        assert summed[k] == pytest.approx(stats[k].item(), rel=1e-5, abs=1e-6), k
    assert torch.allclose(new_full.grad, grad_full, rtol=1e-5, atol=1e-7)


def test_actor_loss_terms_by_hand():
    # one sequence: a prompt token then two response tokens; ratio 1 (on-policy)
    logprobs = torch.tensor([0.0, math.log(0.5), math.log(0.25)])
    batch = SequenceBatch.from_lists([0], {
        "logprobs": [logprobs], "ref_logprobs": [torch.tensor([0.0, math.log(0.25), math.log(0.25)])],
        "advantages": [torch.tensor([0.0, 2.0, 2.0])], "loss_mask": [torch.tensor([0.0, 1.0, 1.0])]})
    entropy = torch.tensor([0.0, 1.0, 0.5])
    loss_fn = ActorLoss(clip_low=0.2, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, stats = loss_fn({"logprobs": logprobs, "entropy": entropy}, batch, 2.0)
    kl = (0.5 - 1 + LN2 + 0.0) / 2  # k3 at x = log 2 and at x = 0, averaged over two tokens
    assert stats["policy_loss"].item() == pytest.approx(-2.0)
    assert stats["kl"].item() == pytest.approx(kl)
    assert stats["entropy"].item() == pytest.approx(0.75)
    assert stats["clip_frac"].item() == 0.0 and stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * kl - 0.01 * 0.75)
    # with the KL in the reward (kl_coef 0 here) the KL to the reference is still reported
    loss, stats = ActorLoss(clip_low=0.2)({"logprobs": logprobs}, batch, 2.0)
    assert loss.item() == pytest.approx(-2.0) and stats["kl"].item() == pytest.approx(kl)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs the engine to return 'entropy'"):
        loss_fn({"logprobs": logprobs}, batch, 2.0)
    with pytest.raises(KeyError, match=r"lacks token fields \['advantages'\]"):
        loss_fn({"logprobs": logprobs}, SequenceBatch(batch.sample_ids, batch.lengths,
                                                       {"logprobs": logprobs, "loss_mask": torch.ones(3)}), 2.0)


def test_actor_loss_from_config_leaves_reward_kl_out_of_the_loss():
    algo = AlgorithmConfig(name="ppo", kl=KLConfig(coef=0.1, in_reward=True, estimator="k1"), clip_low=0.1,
                           clip_high=0.3, loss_agg="seq-mean-token-sum", policy_loss="ppo_clip")
    fn = actor_loss(algo, 0.05)
    assert fn.kl_coef == 0.0 and fn.clip_high == 0.3 and fn.loss_agg == "seq-mean-token-sum"
    as_loss = AlgorithmConfig(kl=KLConfig(coef=0.1, in_reward=False, estimator="k3"), clip_low=0.2,
                              loss_agg="token-mean", policy_loss="ppo_clip")
    assert actor_loss(as_loss, 0.05).kl_coef == 0.05


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_critic_loss_by_hand_and_across_micro_batches(mode):
    batch = SequenceBatch.from_lists([0, 1], {
        "values": [torch.tensor([0.0, 0.5, 0.5]), torch.tensor([0.0, 0.5])],
        "returns": [torch.tensor([0.0, 0.0, 3.0]), torch.tensor([0.0, 1.0])],
        "loss_mask": [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]})
    new = torch.tensor([5.0, 1.0, 2.0, 5.0, 0.5])
    loss_fn = CriticLoss(value_clip=0.2, loss_agg=mode)
    loss, stats = loss_fn({"values": new}, batch, loss_fn.normalizer(batch))
    # per token: 0.5 and 2.645 (as in test_clipped_value_loss_by_hand) and 0.5 * (0.5 - 1)^2 = 0.125
    expected = (0.5 + 2.645 + 0.125) / 3 if mode == "token-mean" else ((0.5 + 2.645) + 0.125) / 2
    assert loss.item() == pytest.approx(expected)
    clip_frac = 1 / 3 if mode == "token-mean" else (0.5 + 0.0) / 2
    assert stats["value_clip_frac"].item() == pytest.approx(clip_frac)
    normalizer = loss_fn.normalizer(batch)
    parts = [loss_fn({"values": new[:3]}, batch.select([0]), normalizer)[0],
             loss_fn({"values": new[3:]}, batch.select([1]), normalizer)[0]]
    assert sum(p.item() for p in parts) == pytest.approx(expected)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    ratio = torch.tensor([3.0, 3.0, 0.5])
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, bounded = clipped_surrogate(ratio.log(), torch.zeros(3), adv, clip_low=0.2, dual_clip=1.5)
    # A < 0, r = 3: PPO's loss max(3, 1.2) = 3, capped at 1.5 | A > 0: -min(3, 1.2) = -1.2 | r = 0.5: 0.8
    assert torch.allclose(loss, torch.tensor([1.5, -1.2, 0.8]))
    assert bounded.tolist() == [1.0, 1.0, 1.0]


def test_gspo_ratio_is_per_sequence_and_clipped_sequences_get_no_gradient():
    """Two sequences (2 and 1 response tokens): s = exp(mean of the token log-ratios), clipped
    per sequence; with seq-mean-token-mean the gradient by each token's log-probability is
    -A s / |y| where s is not clipped, 0 where it is."""
    old = torch.zeros(5)
    new = torch.tensor([0.0, 0.1, 0.3, 0.0, 0.05], requires_grad=True)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    lengths = torch.tensor([3, 2])
    adv = torch.tensor([0.0, 2.0, 2.0, 0.0, -1.0])
    loss, bounded = sequence_surrogate(new, old, adv, mask, lengths, clip_low=0.1, clip_high=0.1)
    s0, s1 = math.exp(0.2), math.exp(0.05)
    assert s0 > 1.1 > s1 > 0.9  # sequence 0 (A > 0) clipped, sequence 1 inside
    assert loss[1].item() == pytest.approx(-2 * 1.1) and loss[4].item() == pytest.approx(s1)
    assert bounded[1].item() == 1.0 and bounded[4].item() == 0.0
    total = aggregate(loss, mask, lengths, "seq-mean-token-mean", 2.0)
    total.backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.0 * s1 / 1 / 2])  # -A s / |y| / sequences


def test_constant_length_aggregation_by_hand():
    per_token = torch.tensor([0.0, 1.0, 3.0, 0.0, 2.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    lengths = torch.tensor([3, 2])
    # each response's sum over one length (8), averaged over the 2 sequences: (4 / 8 + 2 / 8) / 2
    value = aggregate(per_token, mask, lengths, "seq-mean-token-sum-norm", 2.0, norm_length=8.0)
    assert value.item() == pytest.approx(0.375)
    assert normalizer_count(mask, lengths, "seq-mean-token-sum-norm") == 2.0
