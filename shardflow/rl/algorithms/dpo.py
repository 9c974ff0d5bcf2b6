"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023) on rows with a prompt, a chosen and a
rejected response, with the reference model's log-probabilities from a ``ref_inf`` call in its
own layout, on the same runtime, plans and checkpoints as RL.

With z = beta ((log pi - log ref)(chosen) - (log pi - log ref)(rejected)) summed over each
response's tokens, the loss of a pair is -(1 - e) log sigmoid(z) - e log sigmoid(-z) (e: label
smoothing), or IPO's (z / beta - 1 / (2 beta))^2. It is not a sum over tokens, so the step is
taken in two passes: an ``actor_inf`` call gives every response's log-probabilities under the
current policy, from which each pair's dL/dz follows (gathered over the data-parallel replicas,
so pairs may be split anywhere); the train call then minimises the weighted log-likelihood
whose gradient is exactly the DPO gradient at those weights (exact for one optimizer step per
call; with several, the weights are those of the call's start). The loss, the accuracy of the
implicit reward (z > 0) and the margins are measured in the first pass.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.advantages import on_response_tokens
from shardflow.rl.algorithms.base import Algorithm
from shardflow.rl.algorithms.sft import EXAMPLES
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.losses import likelihood_loss


def graph(config: ExperimentConfig) -> Graph:
    calls = (Call("ref_inf", Kind.INFERENCE, "ref", (EXAMPLES,), ("ref_logprobs",)),
             Call("actor_inf", Kind.INFERENCE, "actor", (EXAMPLES,), ("logprobs",)),
             Call("actor_train", Kind.TRAIN, "actor", (EXAMPLES, "ref_logprobs", "logprobs")))
    return Graph("dpo", calls, sources=(EXAMPLES,))


def pair_losses(z: torch.Tensor, algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of each pair [P] and its derivative by the log-ratio margin m = z / beta [P], float64."""
    beta, eps = algo.dpo.beta, algo.dpo.label_smoothing
    m = z / beta
    if algo.dpo.loss == "ipo":
        target = 1.0 / (2.0 * beta)
        return (m - target).square(), 2.0 * (m - target)
    loss = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    return loss, -beta * ((1 - eps) * torch.sigmoid(-z) - eps * torch.sigmoid(z))


def pair_weights(batch: SequenceBatch, algo: AlgorithmConfig,
                 group: ProcessGroup | None) -> tuple[SequenceBatch, dict[str, float]]:
    """The share with ``advantages`` -2 dL/dm on its chosen responses' tokens and +2 dL/dm on its
    rejected ones (so that seq-mean-token-sum over the 2P responses averages over the P pairs)."""
    mask = (batch.token_fields["loss_mask"] > 0).double()
    log_ratio = (batch.token_fields["logprobs"].double() - batch.token_fields["ref_logprobs"].double()) * mask
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    ratios = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, seq, log_ratio)  # [N]
    mine = (batch.seq_fields["prompt_index"].tolist(), batch.seq_fields["completion"].tolist(), ratios.tolist())
    parts = [mine]
    if group is not None:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    margins: dict[int, list[float]] = {}
    for rows, which, values in parts:
        for row, j, value in zip(rows, which, values):
            margins.setdefault(row, [math.nan, math.nan])[j] = value
    rows = sorted(margins)
    chosen = torch.tensor([margins[r][0] for r in rows], dtype=torch.float64)
    rejected = torch.tensor([margins[r][1] for r in rows], dtype=torch.float64)
    if torch.isnan(chosen).any() or torch.isnan(rejected).any():
        raise RuntimeError("a DPO pair lacks its chosen or its rejected response on every replica")
    z = algo.dpo.beta * (chosen - rejected)
    losses, slopes = pair_losses(z, algo)
    slope = dict(zip(rows, slopes.tolist()))
    sign = 1.0 - 2.0 * batch.seq_fields["completion"].double()  # +1 chosen, -1 rejected
    weights = torch.tensor([-2.0 * slope[r] for r in batch.seq_fields["prompt_index"].tolist()],
                           dtype=torch.float64) * sign
    metrics = {"dpo_loss": float(losses.mean()), "dpo_accuracy": float((z > 0).double().mean()),
               "dpo_margin": float((chosen - rejected).mean()), "chosen_reward": float(algo.dpo.beta * chosen.mean()),
               "rejected_reward": float(algo.dpo.beta * rejected.mean())}
    return batch.update({"advantages": on_response_tokens(batch, weights.float())}), metrics


def check(config: ExperimentConfig) -> None:
    if config.algorithm.loss_agg != "seq-mean-token-sum":
        raise ValueError("algorithm dpo weighs whole responses: algorithm.loss_agg must be seq-mean-token-sum "
                         f"(got {config.algorithm.loss_agg})")


DPO = Algorithm(name="dpo", summary="direct preference optimisation (or IPO) against a reference model", graph=graph,
                preset={"loss_agg": "seq-mean-token-sum", "dpo.beta": 0.1, "dpo.label_smoothing": 0.0,
                        "dpo.loss": "sigmoid"},
                losses={"actor": likelihood_loss}, completions=("chosen_key", "rejected_key"),
                offline_estimator=pair_weights, check=check)
