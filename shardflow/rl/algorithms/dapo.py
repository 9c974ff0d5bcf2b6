"""DAPO (Yu et al. 2025): GRPO with a wider upper clip (clip-higher), the loss averaged over all
tokens of the batch, dynamic sampling (groups whose rewards are all equal are dropped and more
are generated until the batch is full), and a soft penalty on responses that run into the length
limit (over the last fifth of ``generation.max_new_tokens``, by default). No KL by default."""

from __future__ import annotations

from shardflow.config.experiment import ExperimentConfig
from shardflow.rl.algorithms.base import CLIPPED, Algorithm, actor_graph


def overlong_buffer(config: ExperimentConfig) -> int:
    """generation.max_new_tokens // 5

    The last fifth of the length limit (DAPO's 4K of 20K)."""
    return config.generation.max_new_tokens // 5


DAPO = Algorithm(name="dapo", summary="clip-higher, token-level loss, dynamic sampling, overlong shaping",
                 graph=actor_graph("dapo"),
                 preset={**CLIPPED, "clip_low": 0.2, "clip_high": 0.28, "advantage": "grpo",
                         "group_std_normalize": True, "loss_agg": "token-mean", "dynamic_sampling.enabled": True,
                         "overlong.buffer": overlong_buffer,
                         "overlong.filter": False})
