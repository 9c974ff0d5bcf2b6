"""What a call's runner is given, and what it reports.

Every rank walks the same calls in the same order and builds a ``CallContext`` for each; a rank
outside the call's layout still runs the runner (it takes part in the collectives it belongs to
and returns None). ``RunState`` is what a rank keeps across iterations: the tokenizer, the
reward function, the KL coefficient and the generation engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardflow.config.experiment import ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.data.prompts import Prompt
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.plan.execution_plan import ExecutionPlan
from shardflow.rl.advantages import KLController
from shardflow.rl.algorithms.base import Algorithm
from shardflow.rl.graph import Call
from shardflow.rl.rewards.scoring import RewardFn
from shardflow.runtime.models import ModelSlot


@dataclass
class CallReport:
    """What a call reports from this rank (merged over ranks by ``runtime.report``)."""

    metrics: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, list] = field(default_factory=dict)  # per-sequence lists from the holders
    decode_steps: list[tuple[int, float]] = field(default_factory=list)
    span: tuple[float, float] | None = None  # wall-clock start and end on this rank
    adaptive: dict | None = None  # an adaptive generation's trace (layout's first rank)
    errors: list[str] = field(default_factory=list)  # contained failures (a reward that raised), to report


@dataclass
class RunState:
    """A rank's state that outlives one iteration."""

    tokenizer: Any
    eos_token_ids: list[int]
    reward_fn: RewardFn | None  # None when a reward model scores
    kl: KLController
    engines: dict[str, Any] = field(default_factory=dict)  # generate call -> its engine or adaptive generator
    predictor_states: dict[str, dict] = field(default_factory=dict)  # restored, applied when a generator is built


@dataclass
class CallContext:
    world: World
    config: ExperimentConfig
    algorithm: Algorithm
    plan: ExecutionPlan
    call: Call
    layout: Layout  # where the call runs (a function call: where its input is held)
    iteration: int
    prompts: list[Prompt]  # the iteration's prompts (every rank has them)
    state: RunState
    report: CallReport
    slot: ModelSlot | None = None  # the call's model role (model calls)
    model: Transformer | None = None  # this rank's model in ``layout`` (None outside it)
    batch: SequenceBatch | None = None  # the call's inputs on this rank (joined by sample id)

    @property
    def micro_batches(self) -> int | None:
        return self.plan[self.call.name].micro_batches
