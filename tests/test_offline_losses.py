"""DPO/IPO's per-pair weights against autograd of the published losses, and DAPO's overlong
reward shaping by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardflow.config.experiment import AlgorithmConfig, DPOConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.algorithms.dpo import pair_weights
from shardflow.rl.losses import LikelihoodLoss
from shardflow.rl.rewards.shaping import overlong_penalty, shape_overlong


def _pairs(pairs: int, seed: int) -> SequenceBatch:
    """``pairs`` rows, each a chosen then a rejected response after a 2-token prompt; rows in a
    shuffled order so that a pair's two responses are not neighbours."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(2 * pairs, generator=gen).tolist()
    fields = {"logprobs": [], "ref_logprobs": [], "loss_mask": []}
    rows, which = [], []
    for k in order:
        length = 2 + int(torch.randint(1, 5, (1,), generator=gen))
        fields["logprobs"].append(-torch.rand(length, generator=gen) * 3)
        fields["ref_logprobs"].append(-torch.rand(length, generator=gen) * 3)
        fields["loss_mask"].append(torch.cat([torch.zeros(2), torch.ones(length - 2)]))
        rows.append(10 + k // 2)
        which.append(k % 2)
    batch = SequenceBatch.from_lists(range(2 * pairs), fields)
    return batch.update(seq_fields={"prompt_index": torch.tensor(rows), "completion": torch.tensor(which)})


def _published_loss(batch: SequenceBatch, logprobs: torch.Tensor, dpo: DPOConfig) -> torch.Tensor:
    """Mean over the pairs of DPO's (Rafailov et al., with conservative label smoothing) or IPO's
    (Azar et al.) loss, computed directly from the sequences' summed log-ratios."""
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    mask = batch.token_fields["loss_mask"].double()
    per_token = (logprobs.double() - batch.token_fields["ref_logprobs"].double()) * mask
    ratios = torch.zeros(len(batch), dtype=torch.float64).index_add(0, seq, per_token)
    by_row: dict[int, list] = {}
    for i, (row, j) in enumerate(zip(batch.seq_fields["prompt_index"].tolist(),
                                     batch.seq_fields["completion"].tolist())):
        by_row.setdefault(row, [None, None])[j] = ratios[i]
    margins = torch.stack([c - r for c, r in by_row.values()])
    if dpo.loss == "ipo":
        return (margins - 1 / (2 * dpo.beta)).square().mean()
    z = dpo.beta * margins
    eps = dpo.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean()


@pytest.mark.parametrize("dpo", [DPOConfig(beta=0.1, label_smoothing=0.0, loss="sigmoid"),
                                 DPOConfig(beta=0.5, label_smoothing=0.2, loss="sigmoid"),
                                 DPOConfig(beta=0.3, label_smoothing=0.0, loss="ipo")],
                         ids=["dpo", "conservative", "ipo"])
def test_dpo_weights_give_the_published_gradient(dpo):
    batch = _pairs(5, seed=3)
    algo = AlgorithmConfig(loss_agg="seq-mean-token-sum", dpo=dpo)
    weighted, metrics = pair_weights(batch, algo, group=None)
    new = batch.token_fields["logprobs"].clone().requires_grad_()
    loss_fn = LikelihoodLoss(loss_agg="seq-mean-token-sum")
    loss, _ = loss_fn({"logprobs": new}, weighted, loss_fn.normalizer(weighted))
    loss.backward()

    reference = batch.token_fields["logprobs"].clone().double().requires_grad_()
    expected = _published_loss(batch, reference, dpo)
    expected.backward()
    assert metrics["dpo_loss"] == pytest.approx(expected.item(), rel=1e-9)
    assert torch.allclose(new.grad.double(), reference.grad, rtol=1e-5, atol=1e-7)
    assert new.grad.abs().sum() > 0  # the comparison is not between two zeros


def test_dpo_weights_split_over_replicas_equal_the_whole(monkeypatch):
    """Pairs split anywhere over two data-parallel replicas: each replica's weights, from the
    margins gathered over both (the gather played here by a stand-in), equal the whole batch's."""
    import shardflow.rl.algorithms.dpo as dpo_module

    batch = _pairs(4, seed=5)
    algo = AlgorithmConfig(loss_agg="seq-mean-token-sum", dpo=DPOConfig(beta=0.2, label_smoothing=0.0,
                                                                       loss="sigmoid"))
    whole, whole_metrics = pair_weights(batch, algo, group=None)
    shares = [list(range(3)), list(range(3, 8))]

    def gather(parts, obj, group):
        for k, ids in enumerate(shares):  # every replica's (rows, completions, margins)
            part = batch.select(ids)
            parts[k] = obj if ids == shares[group] else _share_margins(part)

    monkeypatch.setattr(dpo_module.dist, "get_world_size", lambda group: len(shares))
    monkeypatch.setattr(dpo_module.dist, "all_gather_object", gather)
    for k, ids in enumerate(shares):
        weighted, metrics = pair_weights(batch.select(ids), algo, group=k)
        assert torch.allclose(weighted.token_fields["advantages"], whole.select(ids).token_fields["advantages"])
        assert metrics == pytest.approx(whole_metrics)
    # one share alone lacks the partners of some of its rows: refused, not guessed
    with pytest.raises(RuntimeError, match="lacks its chosen or its rejected response"):
        pair_weights(batch.select(shares[0]), algo, group=None)


def _share_margins(share: SequenceBatch) -> tuple[list, list, list]:
    seq = torch.repeat_interleave(torch.arange(len(share)), share.lengths)
    per_token = (share.token_fields["logprobs"].double() - share.token_fields["ref_logprobs"].double())
    ratios = torch.zeros(len(share), dtype=torch.float64).index_add(0, seq, per_token * share.token_fields["loss_mask"])
    return share.seq_fields["prompt_index"].tolist(), share.seq_fields["completion"].tolist(), ratios.tolist()


def test_dpo_metrics_by_hand():
    # one pair: chosen log-ratio 1.0 (one token), rejected -1.0: z = beta * 2
    batch = SequenceBatch.from_lists([0, 1], {
        "logprobs": [torch.tensor([0.0, -1.0]), torch.tensor([0.0, -3.0])],
        "ref_logprobs": [torch.tensor([0.0, -2.0]), torch.tensor([0.0, -2.0])],
        "loss_mask": [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])]})
    batch = batch.update(seq_fields={"prompt_index": torch.tensor([7, 7]), "completion": torch.tensor([0, 1])})
    algo = AlgorithmConfig(loss_agg="seq-mean-token-sum", dpo=DPOConfig(beta=0.5, label_smoothing=0.0, loss="sigmoid"))
    weighted, metrics = pair_weights(batch, algo, group=None)
    z = torch.tensor(1.0, dtype=torch.float64)
    assert metrics["dpo_loss"] == pytest.approx(-F.logsigmoid(z).item())
    assert metrics["dpo_accuracy"] == 1.0 and metrics["dpo_margin"] == pytest.approx(2.0)
    assert metrics["chosen_reward"] == pytest.approx(0.5) and metrics["rejected_reward"] == pytest.approx(-0.5)
    # weights -2 dL/dm = 2 beta sigmoid(-z): + on the chosen response, - on the rejected one
    w = 2 * 0.5 * torch.sigmoid(-z).item()
    assert weighted.token_fields["advantages"].tolist() == pytest.approx([0.0, w, 0.0, -w])


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    # max 16, buffer 4: free up to 12 tokens, then -1/4 per token to -penalty at 16, flat beyond
    got = overlong_penalty(lengths, max_len=16, buffer=4, penalty=2.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    assert overlong_penalty(lengths, max_len=16, buffer=0, penalty=2.0).tolist() == [0.0] * 6


def test_shape_overlong_adds_the_penalty_and_masks_truncated_responses():
    # responses of 2, 3 and 4 tokens after a 1-token prompt; the limit is 4
    fields = {"loss_mask": [torch.tensor([0.0] + [1.0] * n) for n in (2, 3, 4)]}
    batch = SequenceBatch.from_lists([0, 1, 2], fields).update(seq_fields={"rewards": torch.tensor([1.0, 1.0, 1.0])})
    shaped = shape_overlong(batch, max_len=4, buffer=2, penalty=1.0, filter_truncated=True)
    assert shaped.seq_fields["rewards"].tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert shaped.token_fields["loss_mask"].tolist() == [0, 1, 1] + [0, 1, 1, 1] + [0, 0, 0, 0, 0]
    kept = shape_overlong(batch, max_len=4, buffer=0, penalty=1.0, filter_truncated=False)
    assert kept.seq_fields["rewards"].tolist() == [1.0, 1.0, 1.0]
    assert kept.token_fields["loss_mask"].tolist() == batch.token_fields["loss_mask"].tolist()
