"""RLOO (Ahmadian et al. 2024): each sample's baseline is the mean reward of the other samples of
its prompt; the KL (k1, summed over the response) is taken from the reward, as TRL does."""

from __future__ import annotations

from shardflow.rl.algorithms.base import CLIPPED, Algorithm, actor_graph

RLOO = Algorithm(name="rloo", summary="leave-one-out baseline of the other samples' rewards",
                 graph=actor_graph("rloo"),
                 preset={**CLIPPED, "advantage": "rloo", "loss_agg": "token-mean", "kl.in_reward": True,
                         "kl.estimator": "k1"})
