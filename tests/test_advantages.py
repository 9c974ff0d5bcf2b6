"""GAE, group advantages, whitening and the KL controller against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from shardflow.config.experiment import AlgorithmConfig, KLConfig
from shardflow.config.load import load_config
from shardflow.data.batch import SequenceBatch
from shardflow.parallel.layout import Layout
from shardflow.rl.advantages import KLController, gae, group_advantages, sequence_kl, whiten
from shardflow.rl.algorithms import ALGORITHMS, algorithm_named
from shardflow.rl.algorithms.base import Algorithm
from shardflow.runtime.validate import check_config


def compute_advantages(batch, algo, *, kl_coef=0.0, group=None):
    """The estimator of the algorithm that ``algo`` names."""
    return algorithm_named(algo.name).advantages(batch, algo, kl_coef, group)


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
                                                   kl=KLConfig(in_reward=True, estimator="k1")), kl_coef=0.1)
    assert kl.token_fields["advantages"][2].item() == pytest.approx(0.1052, abs=1e-6)
    grpo = compute_advantages(grpo_batch([1.0, 0.0], [0, 0]), AlgorithmConfig(name="grpo"))
    assert "returns" not in grpo.token_fields and grpo.token_fields["advantages"][1] > 0


def test_a_new_algorithm_is_one_registered_entry(monkeypatch):
    def leave_one_out(batch, algo, kl_coef, group):
        return batch.update({"advantages": torch.ones(batch.num_tokens)})

    grpo = ALGORITHMS["grpo"]
    monkeypatch.setitem(ALGORITHMS, "rloo", Algorithm(name="rloo", summary="test", graph=grpo.graph,
                                                      advantages=leave_one_out, losses=grpo.losses))
    algo = AlgorithmConfig(name="rloo")
    assert compute_advantages(grpo_batch([1.0], [0]), algo).token_fields["advantages"].tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="algorithm.name must be one of grpo, ppo, rloo; got 'remax'"):
        compute_advantages(grpo_batch([1.0], [0]), AlgorithmConfig(name="remax"))


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


def test_config_refuses_kl_settings_that_cannot_work():
    base = {"models": {"actor": {"path": "a"}, "ref": {"path": "r"}}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ValueError, match="algorithm.kl.in_reward needs a per-token reward, i.e. algorithm.name=ppo"):
        check_config(load_config(None, ["algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true"], base=base))
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


@pytest.mark.parametrize("name", ["grpo", "ppo"])
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
