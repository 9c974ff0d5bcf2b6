"""GRPO (Shao et al. 2024) and Dr. GRPO (Liu et al. 2025): several samples per prompt, each
advantage its reward less its group's mean, no critic.

Graph: generate, reward, (reference log-probabilities when a KL is used), train the actor. GRPO
divides the centred rewards by the group's std; Dr. GRPO does not, and sums each response's token
losses over one constant length (the generation limit) instead of its own, which removes GRPO's
bias toward long wrong answers and short right ones.
"""

from __future__ import annotations

from shardflow.rl.algorithms.base import CLIPPED, Algorithm, actor_graph

GRPO = Algorithm(name="grpo", summary="group-normalised rewards, clipped policy loss, no critic",
                 graph=actor_graph("grpo"),
                 preset={**CLIPPED, "advantage": "grpo", "group_std_normalize": True, "loss_agg": "token-mean"})

DR_GRPO = Algorithm(name="dr_grpo", summary="GRPO without the std division and the length normalisation",
                    graph=actor_graph("dr_grpo"),
                    preset={**CLIPPED, "advantage": "grpo", "group_std_normalize": False,
                            "loss_agg": "seq-mean-token-sum-norm"})
