"""GAE, group advantages, whitening and the KL controller against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig, KLConfig
from shardflow.config.load import load_config
from shardflow.data.batch import SequenceBatch
from shardflow.parallel.layout import Layout
from shardflow.rl.advantages import (
    ADVANTAGES,
    AdvantageEstimator,
    KLController,
    discounted_returns,
    gae,
    group_advantages,
    sequence_kl,
    whiten,
)
from shardflow.rl.algorithms import ALGORITHMS, algorithm_named
from shardflow.rl.algorithms.base import Algorithm
from shardflow.runtime.validate import check_config


def compute_advantages(batch, algo, *, kl_coef=0.0, group=None):
    """The estimator of the algorithm that ``algo`` names, its knobs resolved."""
    algorithm = algorithm_named(algo.name)
    return algorithm.advantages(batch, algorithm.resolve(ExperimentConfig(algorithm=algo)).algorithm, kl_coef, group)[0]


def ppo_batch() -> SequenceBatch:
    """Sequence 0: 2 prompt + 3 response tokens, reward 1; sequence 1: 1 prompt + 1 response, reward -1.
    Prompt positions hold values (9.0) that must not matter."""
    return SequenceBatch.from_lists([0, 1], {
        "values": [torch.tensor([9.0, 9.0, 0.5, 0.4, 0.3]), torch.tensor([9.0, 0.2])],
        "loss_mask": [torch.tensor([0.0, 0, 1, 1, 1]), torch.tensor([0.0, 1])],
        "logprobs": [torch.tensor([0.0, 0, -1.0, -1.0, -1.5]), torch.tensor([0.0, -1.0])],
        "ref_logprobs": [torch.tensor([0.0, 0, -1.5, -1.0, -1.0]), torch.tensor([0.0, -1.0])],
    }, {"rewards": torch.tensor([1.0, -1.0])})


def test_gae_by_hand():
    out = gae(ppo_batch(), gamma=0.9, lam=0.8)
    # sequence 0 (gamma * lam = 0.72):
    #   t2: delta = 1 - 0.3 = 0.7                       A = 0.7
    #   t1: delta = 0.9 * 0.3 - 0.4 = -0.13             A = -0.13 + 0.72 * 0.7 = 0.374
    #   t0: delta = 0.9 * 0.4 - 0.5 = -0.14             A = -0.14 + 0.72 * 0.374 = 0.12928
    # sequence 1: delta = -1 - 0.2 = -1.2
    expected = torch.tensor([0, 0, 0.12928, 0.374, 0.7, 0, -1.2])
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-6)
    # returns = A + V on response tokens
    returns = torch.tensor([0, 0, 0.62928, 0.774, 1.0, 0, -1.0])
    assert torch.allclose(out.token_fields["returns"], returns, atol=1e-6)


def test_gae_with_kl_in_the_reward_by_hand():
    out = gae(ppo_batch(), gamma=0.9, lam=0.8, kl_coef=0.1, kl_estimator="k1")
    # k1 = logprobs - ref = 0.5, 0, -0.5 -> rewards -0.05, 0, 1 + 0.05
    #   t2: delta = 1.05 - 0.3 = 0.75                   A = 0.75
    #   t1: delta = 0.27 - 0.4 = -0.13                  A = -0.13 + 0.72 * 0.75 = 0.41
    #   t0: delta = -0.05 + 0.36 - 0.5 = -0.19          A = -0.19 + 0.72 * 0.41 = 0.1052
    expected = torch.tensor([0, 0, 0.1052, 0.41, 0.75, 0, -1.2])
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    out = gae(ppo_batch(), gamma=1.0, lam=1.0)
    expected = torch.tensor([0, 0, 1 - 0.5, 1 - 0.4, 1 - 0.3, 0, -1 - 0.2])
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-6)
    assert torch.allclose(out.token_fields["returns"], torch.tensor([0, 0, 1.0, 1, 1, 0, -1]), atol=1e-6)


def grpo_batch(rewards, prompt_index) -> SequenceBatch:
    n = len(rewards)
    return SequenceBatch.from_lists(range(n), {"loss_mask": [torch.tensor([0.0, 1.0, 1.0])] * n},
                                    {"rewards": torch.tensor(rewards), "prompt_index": torch.tensor(prompt_index)})


def test_group_advantages_by_hand():
    batch = grpo_batch([1.0, 0.0, 0.0, 0.5, 0.5, 1.0], [7, 7, 7, 3, 3, 9])
    out = group_advantages(batch)
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = (1 / 3) ** 0.5
    per_seq = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0]  # equal rewards and a lone sample: 0
    expected = torch.tensor([[0.0, a, a] for a in per_seq]).flatten()
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-5)
    out = group_advantages(batch, std_normalize=False)
    expected = torch.tensor([[0.0, a, a] for a in [2 / 3, -1 / 3, -1 / 3, 0, 0, 0]]).flatten()
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-6)


def test_group_of_identical_rewards_gets_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; the division by a tiny std must not blow that up
    for value in (0.1, 0.7, 1 / 3):
        out = group_advantages(grpo_batch([value] * 3, [0, 0, 0]))
        assert torch.equal(out.token_fields["advantages"], torch.zeros(9))


def test_rloo_by_hand():
    """Each sample less the mean of its group's others; groups of one and equal groups get 0."""
    batch = grpo_batch([1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 4.0, -2.0], [7, 7, 7, 3, 3, 9, 5, 5])
    out = group_advantages(batch, baseline="leave_one_out")
    per_seq = [1 - 0, 0 - 0.5, 0 - 0.5, 0.0, 0.0, 0.0, 4 - (-2), -2 - 4]
    expected = torch.tensor([[0.0, a, a] for a in per_seq]).flatten()
    assert torch.allclose(out.token_fields["advantages"], expected, atol=1e-6)


def test_extreme_rewards_keep_their_group_baseline_exact():
    """float64 rewards of 1e12 apart by 1: the centring is exact (group std 1), and so is RLOO's."""
    def batch(rewards):
        return grpo_batch([0.0] * len(rewards), [0] * len(rewards)).update(
            seq_fields={"rewards": torch.tensor(rewards, dtype=torch.float64)})

    out = group_advantages(batch([1e12 + 1, 1e12, 1e12 - 1]))
    assert torch.allclose(out.token_fields["advantages"].view(3, 3)[:, 1], torch.tensor([1.0, 0.0, -1.0]), atol=1e-5)
    out = group_advantages(batch([1e12 + 1, 1e12]), baseline="leave_one_out")
    assert out.token_fields["advantages"].view(2, 3)[:, 1].tolist() == [1.0, -1.0]


def _response_batch(rewards, lengths, masks, **fields):
    """Sequences of ``lengths`` tokens with the given masks (response tokens may have gaps)."""
    n = len(rewards)
    return SequenceBatch.from_lists(range(n), {"loss_mask": [torch.tensor(m) for m in masks],
                                               **{k: [torch.tensor(v) for v in vs] for k, vs in fields.items()}},
                                    {"rewards": torch.tensor(rewards), "prompt_index": torch.tensor([0, 0, 1][:n])})


def test_discounted_returns_by_hand_with_a_masked_token_inside_a_response():
    # sequence 0: prompt, r1, (an observation token, masked), r2; sequence 1: prompt, r1
    batch = _response_batch([2.0, -1.0], [4, 2], [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0]])
    returns = discounted_returns(batch, gamma=0.5)
    # the reward sits on the last response token; the masked token is not a step: G = [1, 2] then [-1]
    assert returns.tolist() == [0.0, 1.0, 0.0, 2.0, 0.0, -1.0]
    lp = [[0.0, -1.0, 0.0, -1.0], [0.0, -1.0]]
    ref = [[0.0, -2.0, 0.0, -1.5], [0.0, -1.0]]
    kl_batch = _response_batch([2.0, -1.0], [4, 2], [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0]], logprobs=lp, ref_logprobs=ref)
    returns = discounted_returns(kl_batch, gamma=1.0, kl_coef=0.1, kl_estimator="k1")
    # k1 per response token: 1.0 and 0.5 -> rewards [-0.1, 2 - 0.05]; returns [1.85, 1.95]; sequence 1: -1
    assert torch.allclose(returns, torch.tensor([0.0, 1.85, 0.0, 1.95, 0.0, -1.0]))


def test_reinforce_pp_estimators_by_hand():
    base = {"generation": {"samples_per_prompt": 2}}
    batch = _response_batch([2.0, 0.0, 1.0], [3, 2, 2], [[0.0, 1.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    config = ExperimentConfig(algorithm=AlgorithmConfig(name="reinforce_pp", gamma=1.0), **{})
    algo = algorithm_named("reinforce_pp").resolve(config).algorithm
    out = ADVANTAGES["reinforce_pp"].compute(batch, algo, 0.0, None).token_fields["advantages"]
    returns = torch.tensor([2.0, 2.0, 0.0, 1.0])  # every response token's return
    mask = batch.token_fields["loss_mask"] > 0
    expected = (returns - returns.mean()) / returns.std()
    assert torch.allclose(out[mask], expected, atol=1e-6)
    algo = algorithm_named("reinforce_pp_baseline").resolve(config).algorithm
    out = ADVANTAGES["reinforce_pp_baseline"].compute(batch, algo, 0.0, None).token_fields["advantages"]
    centred = torch.tensor([1.0, 1.0, -1.0, 0.0])  # group 0: 2 and 0 less their mean 1; group 1 alone: 0
    assert torch.allclose(out[mask], (centred - centred.mean()) / centred.std(), atol=1e-6)
    del base


def test_remax_subtracts_the_greedy_reward():
    batch = _response_batch([2.0, 0.0], [3, 2], [[0.0, 1.0, 1.0], [0.0, 1.0]])
    batch = batch.update(seq_fields={"baseline_rewards": torch.tensor([0.5, 1.0])})
    algo = algorithm_named("remax").resolve(ExperimentConfig(algorithm=AlgorithmConfig(name="remax"))).algorithm
    out = ADVANTAGES["remax"].compute(batch, algo, 0.0, None).token_fields["advantages"]
    assert out.tolist() == [0.0, 1.5, 1.5, 0.0, -1.0]


def test_sequence_estimators_take_the_kl_in_the_reward_summed_over_the_response():
    lp, ref = [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], [[0.0, -2.0, -1.0], [0.0, -1.0, -1.0]]
    batch = _response_batch([1.0, 1.0], [3, 3], [[0.0, 1.0, 1.0]] * 2, logprobs=lp, ref_logprobs=ref)
    algo = AlgorithmConfig(name="rloo", kl=KLConfig(coef=0.5, in_reward=True, estimator="k1"))
    out = compute_advantages(batch, algo, kl_coef=0.5).token_fields["advantages"]
    # rewards less 0.5 x summed k1: 1 - 0.5 and 1 - 0: leave-one-out -0.5 and +0.5
    assert out.tolist() == [0.0, -0.5, -0.5, 0.0, 0.5, 0.5]


def test_whiten_stays_precise_far_from_zero():
    """|mean| / std of 30: the two-pass float64 form is exact to float32's rounding of the inputs."""
    gen = torch.Generator().manual_seed(0)
    values = 30.0 + torch.randn(4096, generator=gen)
    mask = torch.ones(4096)
    exact = (values.double() - values.double().mean()) / values.double().std()
    assert (whiten(values, mask).double() - exact).abs().max() < 1e-6


def test_whiten_by_hand():
    values, mask = torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased variance 1
    assert torch.allclose(whiten(values, mask), torch.tensor([-1.0, 0.0, 1.0, 0.0]), atol=1e-6)
    with pytest.raises(ValueError, match="cannot whiten over 1 response token"):
        whiten(values, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_compute_advantages_per_algorithm():
    batch = ppo_batch()
    ppo = compute_advantages(batch, AlgorithmConfig(name="ppo", gamma=0.9, lam=0.8))
    raw = gae(batch, gamma=0.9, lam=0.8).token_fields["advantages"]
    mask = batch.token_fields["loss_mask"]
    assert torch.allclose(ppo.token_fields["advantages"], whiten(raw, mask))
    response = ppo.token_fields["advantages"][mask > 0]
    assert response.mean().abs() < 1e-6 and (response.std() - 1).abs() < 1e-5
    # KL in the reward only with kl_in_reward
    kl = compute_advantages(batch, AlgorithmConfig(name="ppo", gamma=0.9, lam=0.8, whiten_advantages=False,
                                                   kl=KLConfig(coef=0.1, in_reward=True, estimator="k1")), kl_coef=0.1)
    assert kl.token_fields["advantages"][2].item() == pytest.approx(0.1052, abs=1e-6)
    grpo = compute_advantages(grpo_batch([1.0, 0.0], [0, 0]), AlgorithmConfig(name="grpo"))
    assert "returns" not in grpo.token_fields and grpo.token_fields["advantages"][1] > 0


def test_a_new_algorithm_is_one_registered_entry(monkeypatch):
    def ones(batch, algo, kl_coef, group):
        return batch.update({"advantages": torch.ones(batch.num_tokens)})

    monkeypatch.setitem(ADVANTAGES, "ones", AdvantageEstimator(compute=ones))
    grpo = ALGORITHMS["grpo"]
    monkeypatch.setitem(ALGORITHMS, "all_ones", Algorithm(name="all_ones", summary="test", graph=grpo.graph,
                                                          preset={**grpo.preset, "advantage": "ones"}))
    algo = AlgorithmConfig(name="all_ones")
    assert compute_advantages(grpo_batch([1.0], [0]), algo).token_fields["advantages"].tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="algorithm.name must be one of ppo, grpo, .*all_ones; got 'nosuch'"):
        compute_advantages(grpo_batch([1.0], [0]), AlgorithmConfig(name="nosuch"))


def test_kl_controller_by_hand():
    c = KLController(value=0.2, target=6.0, horizon=10000)
    c.update(9.0, 100)  # error 0.5 clipped to 0.2: 0.2 * (1 + 0.2 * 100 / 10000)
    assert c.value == pytest.approx(0.2004)
    c.update(5.4, 100)  # error -0.1: 0.2004 * (1 - 0.1 * 0.01)
    assert c.value == pytest.approx(0.2004 * 0.999)
    fixed = KLController.from_config(KLConfig(coef=0.05))
    fixed.update(100.0, 100)
    assert fixed.value == 0.05
    restored = KLController(value=1.0, target=6.0)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value


def test_sequence_kl_by_hand():
    # sequence 0: 0.5 + 0 - 0.5 = 0; sequence 1: 0 -> mean 0; shift one token to make it non-zero
    batch = ppo_batch()
    assert sequence_kl(batch) == pytest.approx(0.0)
    lp = batch.token_fields["logprobs"].clone()
    lp[6] = -0.2  # sequence 1: -0.2 - (-1.0) = 0.8
    assert sequence_kl(batch.update({"logprobs": lp})) == pytest.approx(0.4)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.lam=0.9"], r"algorithm.lam is set, but algorithm grpo's advantage estimator \(grpo\) does not use "
                            r"it \(it is read by: gae\)"),
    (["algorithm.advantage=gae"], r"algorithm.advantage=gae needs a critic \(algorithm.name=ppo\); algorithm grpo's "
                                  "graph has none"),
    (["algorithm.advantage=nosuch"], "algorithm.advantage must be one of gae, grpo, rloo"),
    (["algorithm.name=gspo", "algorithm.dual_clip=3"], "algorithm.dual_clip is set, but the policy loss gspo does "
                                                       "not use it"),
    (["algorithm.name=rloo", "generation.samples_per_prompt=1"], "algorithm.advantage=rloo compares the samples of "
                                                                 "a prompt: generation.samples_per_prompt must be"),
    (["algorithm.dpo.beta=0.5"], "algorithm.dpo.beta is set, but algorithm grpo is not dpo"),
    (["algorithm.overlong.buffer=8"], r"algorithm.overlong.buffer \(8\) must be less than generation.max_new_tokens"),
])
def test_config_refuses_knobs_the_algorithm_cannot_use(overrides, message):
    base = {"models": {"actor": {"path": "a"}}, "data": {"path": "d.jsonl"},
            "generation": {"samples_per_prompt": 4, "max_new_tokens": 8}}
    with pytest.raises(ValueError, match=message):
        check_config(load_config(None, overrides, base=base))


def test_presets_fill_only_what_is_unset():
    base = {"models": {"actor": {"path": "a"}}, "data": {"path": "d.jsonl"},
            "generation": {"samples_per_prompt": 4, "max_new_tokens": 100}}
    dapo = check_config(load_config(None, ["algorithm.name=dapo", "algorithm.clip_high=0.3"], base=base)).config.algorithm
    assert (dapo.advantage, dapo.clip_low, dapo.clip_high, dapo.loss_agg) == ("grpo", 0.2, 0.3, "token-mean")
    assert dapo.dynamic_sampling.enabled and dapo.overlong.buffer == 20 and dapo.kl.estimator == "k3"
    dr = check_config(load_config(None, ["algorithm.name=dr_grpo"], base=base)).config.algorithm
    assert not dr.group_std_normalize and dr.loss_agg == "seq-mean-token-sum-norm" and dr.lam is None


def test_config_refuses_kl_settings_that_cannot_work():
    base = {"models": {"actor": {"path": "a"}, "ref": {"path": "r"}}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ValueError, match="algorithm.kl.target needs a positive algorithm.kl.coef"):
        check_config(load_config(None, ["algorithm.kl.target=6.0"], base=base))
    with pytest.raises(ValueError, match="algorithm.kl.horizon must be positive"):
        load_config(None, ["algorithm.kl.coef=0.1", "algorithm.kl.target=6.0", "algorithm.kl.horizon=0"], base=base)


def _sharded_advantages_job(world, batch, algo, shares):
    """Each of two replicas computes advantages of its share, exchanging over their group."""
    world.create_groups([Layout.contiguous(dp=2)])
    if world.rank >= 2:
        return None
    group = world.groups.get((0, 1))
    return compute_advantages(batch.select(shares[world.rank]), algo, group=group).token_fields["advantages"]


@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_sharded_advantages_equal_whole_batch(pool, name):
    """GRPO groups split across replicas and PPO whitening over replicas give the whole-batch result."""
    torch.manual_seed(0)
    lengths = [5, 3, 6, 4, 7, 2]
    tokens = sum(lengths)
    mask = torch.cat([torch.tensor([0.0] + [1.0] * (n - 1)) for n in lengths])
    batch = SequenceBatch(torch.arange(6), torch.tensor(lengths),
                          {"loss_mask": mask, "values": torch.randn(tokens), "logprobs": torch.randn(tokens)},
                          {"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5]),
                           "prompt_index": torch.tensor([0, 0, 0, 1, 1, 1])})
    algo = AlgorithmConfig(name=name)
    whole = compute_advantages(batch, algo).token_fields["advantages"]
    shares = [[0, 3, 4], [1, 2, 5]]  # both groups split over the two replicas
    parts = pool.run(_sharded_advantages_job, batch, algo, shares)
    for share, part in zip(shares, parts):
        rows = torch.cat([torch.arange(int(batch.offsets[i]), int(batch.offsets[i + 1])) for i in share])
        torch.testing.assert_close(part, whole[rows], atol=1e-6, rtol=1e-6)
