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
from shardflow.engine.generate.precompile_launch import Helper
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.plan.execution_plan import ExecutionPlan
from shardflow.rl.advantages import KLController
from shardflow.rl.algorithms.base import Algorithm
from shardflow.rl.graph import Call
from shardflow.rl.rewards.texts import RewardFn
from shardflow.rl.workers import WorkerPool
from shardflow.runtime.models import ModelSlot


@dataclass(frozen=True)
class Sampling:
    """How a generate call samples when not as the run's settings say (held-out evaluation)."""

    samples_per_prompt: int
    temperature: float
    max_new_tokens: int  # at most generation.max_new_tokens: the engine's cache is sized by that


@dataclass
class CallReport:
    """What a call reports from this rank (merged over ranks by ``runtime.report``)."""

    metrics: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, list] = field(default_factory=dict)  # per-sequence lists from the holders
    decode_steps: list[tuple[int, float]] = field(default_factory=list)
    span: tuple[float, float] | None = None  # wall-clock start and end on this rank
    adaptive: dict | None = None  # an adaptive generation's trace (layout's first rank)
    errors: list[str] = field(default_factory=list)  # contained failures (a reward that raised), to report

    def absorb(self, other: "CallReport") -> None:
        """Add another round of the same call (dynamic sampling): counts and times add up, memory
        peaks take the larger, lists grow, the span covers both."""
        for key, value in other.metrics.items():
            if key.startswith("memory/"):  # peaks: the larger
                self.metrics[key] = max(self.metrics.get(key, 0.0), value)
            else:
                self.metrics[key] = self.metrics.get(key, 0.0) + value
        for key, values in other.rollout.items():
            self.rollout[key] = self.rollout.get(key, []) + values
        self.decode_steps += other.decode_steps
        self.errors += other.errors
        if other.span is not None:
            self.span = other.span if self.span is None else (min(self.span[0], other.span[0]),
                                                              max(self.span[1], other.span[1]))


@dataclass
class RunState:
    """A rank's state that outlives one iteration."""

    tokenizer: Any
    eos_token_ids: list[int]
    reward_fn: RewardFn | None  # None when a reward model scores
    kl: KLController
    engines: dict[str, Any] = field(default_factory=dict)  # generate call -> its engine or adaptive generator
    predictor_states: dict[str, dict] = field(default_factory=dict)  # restored, applied when a generator is built
    workers: WorkerPool | None = None  # rewards and environments beside decoding (holders of rollouts)
    precompile: Helper | None = None  # the decode steps compiled in a helper process (in the first generate call)

    def worker_pool(self, size: int) -> WorkerPool:
        """The rank's worker pool, started on first use and kept for the run."""
        if self.workers is None:
            self.workers = WorkerPool(size)
        return self.workers

    def close(self) -> None:
        if self.precompile is not None:
            self.precompile.finish()
            self.precompile = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None


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
    round: int = 0  # the generation round of the iteration (dynamic sampling generates several)
    sampling: Sampling | None = None  # a generate call's sampling when not the run's

    @property
    def micro_batches(self) -> int | None:
        return self.plan[self.call.name].micro_batches
