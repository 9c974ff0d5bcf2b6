"""GSPO (Zheng et al. 2025): GRPO's group advantages with the importance ratio taken per sequence
(the geometric mean of its token ratios) and clipped per sequence, in a narrow range."""

from __future__ import annotations

from shardflow.rl.algorithms.base import CLIPPED, Algorithm, actor_graph

GSPO = Algorithm(name="gspo", summary="sequence-level importance ratio, clipped per sequence",
                 graph=actor_graph("gspo"),
                 preset={**CLIPPED, "policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "advantage": "grpo",
                         "group_std_normalize": True, "loss_agg": "seq-mean-token-mean"})
