"""REINFORCE++ (Hu et al. 2025): the return of every response token (the reward at the end, the
KL as a per-token penalty), whitened over the whole batch, with PPO's clipped loss and no critic.
REINFORCE++-baseline first subtracts each reward's group mean (several samples per prompt)."""

from __future__ import annotations

from shardflow.rl.algorithms.base import CLIPPED, Algorithm, actor_graph

TOKEN_KL = {**CLIPPED, "gamma": 1.0, "loss_agg": "token-mean", "kl.in_reward": True, "kl.estimator": "k1"}

REINFORCE_PP = Algorithm(name="reinforce_pp", summary="batch-whitened returns with the KL in the reward",
                         graph=actor_graph("reinforce_pp"), preset={**TOKEN_KL, "advantage": "reinforce_pp"})

REINFORCE_PP_BASELINE = Algorithm(name="reinforce_pp_baseline",
                                  summary="REINFORCE++ with each reward less its group's mean",
                                  graph=actor_graph("reinforce_pp_baseline"),
                                  preset={**TOKEN_KL, "advantage": "reinforce_pp_baseline"})
