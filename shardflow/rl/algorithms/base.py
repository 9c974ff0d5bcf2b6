"""What an algorithm is to shardflow: its graph of calls, advantage estimator and losses.

An ``Algorithm`` entry names everything the runtime and the planner need:

- ``graph(config)``: the dataflow graph of one iteration (``rl.graph``), built from the shared
  pieces of ``rl.graphs`` (generation, reward, reference) plus the algorithm's own calls;
- ``advantages(batch, algo, kl_coef, group)``: one data-parallel replica's share of the batch
  with token fields ``advantages`` (and ``returns`` where a critic trains), computed at the start
  of every train call; ``group`` holds the other replicas (None: the share is the whole batch);
- ``losses``: per trained model role, the loss its train call optimises (``LossFn`` of
  ``engine.train.loss_fn``), from the algorithm settings and the iteration's KL coefficient;
- ``check(config)``: the algorithm's own rules across settings, reported before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.graph import Graph

Estimator = Callable[[SequenceBatch, AlgorithmConfig, float, "ProcessGroup | None"], SequenceBatch]
LossBuilder = Callable[[AlgorithmConfig, float], object]  # (settings, kl_coef) -> a LossFn


def no_rules(config: ExperimentConfig) -> None:
    """An algorithm without rules of its own."""


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    name: str
    summary: str  # one line for --help-config
    graph: Callable[[ExperimentConfig], Graph]
    advantages: Estimator
    losses: Mapping[str, LossBuilder]  # trained model role -> its loss
    check: Callable[[ExperimentConfig], None] = field(default=no_rules)

    def loss(self, role: str, algo: AlgorithmConfig, kl_coef: float):
        """The loss of ``role``'s train call."""
        if role not in self.losses:
            raise ValueError(f"algorithm {self.name!r} trains {sorted(self.losses)}, not {role!r}")
        return self.losses[role](algo, kl_coef)
