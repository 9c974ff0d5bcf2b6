"""GRPO (Shao et al. 2024): several samples per prompt, advantages normalised within each group.

Graph: generate, reward, (reference log-probabilities when a KL is used), train the actor. The
advantage of a sample is its reward minus its group's mean, divided by the group's std unless
``algorithm.group_std_normalize`` is off; the actor loss is PPO's clipped surrogate.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.advantages import group_advantages
from shardflow.rl.algorithms.base import Algorithm
from shardflow.rl.graph import Graph
from shardflow.rl.graphs import rollout_calls, train_call
from shardflow.rl.losses import actor_loss


def graph(config: ExperimentConfig) -> Graph:
    calls = rollout_calls(config)
    return Graph("grpo", (*calls, train_call("actor", calls)))


def advantages(batch: SequenceBatch, algo: AlgorithmConfig, kl_coef: float,
               group: ProcessGroup | None) -> SequenceBatch:
    return group_advantages(batch, std_normalize=algo.group_std_normalize, group=group)


def check(config: ExperimentConfig) -> None:
    if config.algorithm.kl.in_reward:
        raise ValueError("algorithm.kl.in_reward needs a per-token reward, i.e. algorithm.name=ppo "
                         f"(got {config.algorithm.name!r})")


GRPO = Algorithm(name="grpo", summary="group-normalised rewards, clipped policy loss, no critic", graph=graph,
                 advantages=advantages, losses={"actor": actor_loss}, check=check)
