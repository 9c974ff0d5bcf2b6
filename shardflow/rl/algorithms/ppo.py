"""PPO (Schulman et al. 2017) with a learned critic, as in RLHF (Ouyang et al. 2022).

Graph: generate, reward, (reference log-probabilities when a KL is used), critic values, then
train the actor and the critic. Advantages are GAE over each response's tokens (with the KL as a
per-token reward penalty when ``algorithm.kl.in_reward``), whitened over the batch unless
``algorithm.whiten_advantages`` is off; the critic regresses the returns with a clipped error.
"""

from __future__ import annotations

from shardflow.config.experiment import ExperimentConfig
from shardflow.rl.algorithms.base import CLIPPED, Algorithm
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.graphs import rollout_calls, train_call
from shardflow.rl.losses import actor_loss, critic_loss


def graph(config: ExperimentConfig) -> Graph:
    calls = [*rollout_calls(config), Call("critic_inf", Kind.INFERENCE, "critic", ("responses",), ("values",))]
    return Graph("ppo", (*calls, train_call("actor", calls), train_call("critic", calls)))


PPO = Algorithm(name="ppo", summary="GAE advantages from a learned critic, clipped policy and value losses",
                graph=graph, losses={"actor": actor_loss, "critic": critic_loss},
                preset={**CLIPPED, "advantage": "gae", "gamma": 1.0, "lam": 0.95, "whiten_advantages": True,
                        "value_clip": 0.2, "loss_agg": "token-mean"})
