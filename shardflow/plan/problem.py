"""A planning problem: the graph, its models, the cluster, the workload and the cost model, fixed
while plans vary; and a plan as the search sees it (one ``Choice`` per model call)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardflow.config.experiment import ExperimentConfig
from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import OpCosts, Profile
from shardflow.plan.cost import CostModel
from shardflow.plan.memory import AnyLayout, Precision, auto_micro_batch_tokens, trained_state_bytes, weight_bytes
from shardflow.plan.workload import Workload, workload_from_config
from shardflow.rl.algorithms import algorithm_named
from shardflow.rl.graph import Call, Graph, Kind


@dataclass(frozen=True)
class Choice:
    """Where and how one call runs."""

    layout: Layout
    micro_batches: int | None = None  # per DP replica and optimizer step; None for generation

    def __str__(self) -> str:
        return str(self.layout) + (f" x{self.micro_batches}" if self.micro_batches else "")


Plan = tuple[Choice, ...]  # one per model call, in ``Problem.calls`` order


@dataclass(kw_only=True)
class Problem:
    graph: Graph
    models: dict[str, ModelConfig]  # role -> config
    cluster: Cluster
    workload: Workload
    profile: Profile | None = None
    precision: Precision = field(default_factory=Precision)
    checkpointing: dict[str, bool] = field(default_factory=dict)  # role -> recompute activations
    shard_optimizer: dict[str, bool] = field(default_factory=dict)  # role -> optimizer state split over dp
    offload_optimizer: dict[str, bool] = field(default_factory=dict)  # trained role -> optimizer state on the host
    offload: dict[str, bool] = field(default_factory=dict)  # frozen role -> weights in CPU memory
    kv_cache_bytes: float | None = None  # per rank; None = whatever memory is left
    kv_block_size: int = 0  # tokens per block of a paged KV cache; 0 = a slot of max_tokens per sequence
    transposed_weights: bool = False  # generation decodes from transposed copies (GenerationConfig)
    iterations: int = 3  # simulated

    def __post_init__(self) -> None:
        missing = [m for m in self.graph.models() if m not in self.models]
        if missing:
            raise ValueError(f"graph {self.graph.name!r} uses model(s) {missing} with no config")
        self.calls: tuple[Call, ...] = tuple(c for c in self.graph.order if c.kind is not Kind.FUNCTION)
        self.costs = CostModel(OpCosts(self.cluster, self.profile), self.workload, self.precision)
        self.index = {c.name: i for i, c in enumerate(self.calls)}
        self.deps = {c.name: tuple(self.graph.dependencies(c)) for c in self.graph.order}
        # per call: (key, model call whose ranks hold that key's data) for inputs made by calls
        self.data_inputs = {c.name: tuple((k, h) for k in c.inputs if (h := self._holder(self.graph.producer(k))))
                            for c in self.calls}

    def _holder(self, producer: str) -> str | None:
        """The model call whose ranks hold a call's outputs: the call itself, or for a plain-Python
        call, the holder of its first input made by a call (it runs where its inputs are)."""
        if producer == "<data>":
            return None  # every rank reads the dataset itself
        call = self.graph.call(producer)
        if call.kind is not Kind.FUNCTION:
            return producer
        return next((h for k in call.inputs if (h := self._holder(self.graph.producer(k)))), None)

    def home_call(self, model: str) -> Call:
        """Where a model's parameters live between calls: its train call (the optimizer state is
        there), else its first call."""
        return self.graph.home_call(model)

    def trained(self, model: str) -> bool:
        return self.graph.train_call(model) is not None

    def trained_state_bytes(self, model: str, layout: AnyLayout) -> float:
        """Device bytes per rank of a trained model's weights, gradients and optimizer state at home."""
        return trained_state_bytes(self.models[model], layout, self.precision,
                                       sharded=self.shard_optimizer.get(model, False),
                                       offloaded=self.offload_optimizer.get(model, False))

    def steps(self, call: Call) -> int:
        """Optimizer steps (train) or passes (inference) that split the call's sequences."""
        return self.workload.train_steps if call.kind is Kind.TRAIN else 1

    @property
    def kv_tokens_per_sequence(self) -> int:
        """KV positions a sequence takes in the cache: a contiguous slot of the longest, or (paged)
        the mean sequence in whole blocks."""
        w, block = self.workload, self.kv_block_size
        return w.max_tokens if not block else min(w.max_tokens, math.ceil(w.mean_tokens / block) * block)

    def replica_sequences(self, call: Call, layout: AnyLayout) -> int:
        """Sequences of the fullest DP replica per step."""
        return math.ceil(self.workload.sequences / (layout.dp * self.steps(call)))

    def tokens_per_micro_batch(self, call: Call, layout: AnyLayout, micro_batches: int | None) -> float:
        return (self.replica_sequences(call, layout) * self.workload.model_tokens_of(self.models[call.model])
                / (micro_batches or 1))

    def default_micro_batches(self, call: Call, layout: Layout) -> int | None:
        """What the runtime picks without a plan value: enough micro-batches to respect the token
        budget, and at least one per pipeline stage."""
        if call.kind is Kind.GENERATE:
            return None
        tokens = self.replica_sequences(call, layout) * self.workload.model_tokens_of(self.models[call.model])
        k = max(math.ceil(tokens / self.micro_batch_tokens(call, layout)), layout.pp)
        return min(k, self.replica_sequences(call, layout))

    def micro_batch_tokens(self, call: Call, layout: Layout) -> int:
        """The run's token budget, or (unset) the one the runtime sizes by the memory its model's
        state leaves free on a device (``memory.auto_micro_batch_tokens``; other models that share
        the device are not counted)."""
        if self.workload.micro_batch_tokens is not None:
            return self.workload.micro_batch_tokens
        cfg, training = self.models[call.model], call.kind is Kind.TRAIN
        held = (self.trained_state_bytes(call.model, layout) if self.trained(call.model)
                else weight_bytes(cfg, layout, self.precision))
        return auto_micro_batch_tokens(cfg, layout, self.cluster.usable_memory - held, training=training,
                                       checkpointing=training and self.checkpointing.get(call.model, False),
                                       p=self.precision)


def problem_from_config(config: ExperimentConfig, cluster: Cluster, *, profile: Profile | None = None,
                        prompt_tokens: int | None = None, response_mean: float | None = None,
                        response_std: float | None = None, iterations: int = 3) -> Problem:
    """The problem an experiment poses: model shapes from each role's ``config.json`` (a
    directory holding only that file is enough), the workload from the config."""
    graph = algorithm_named(config.algorithm.name).graph(config)
    models = {role: ModelConfig.from_pretrained(config.models[role].path, key=f"models.{role}.path")
              for role in graph.models()}
    if profile is not None:
        cluster = profile.cluster(cluster)
    kv = config.generation.kv_cache_gb
    return Problem(
        graph=graph,
        models=models,
        cluster=cluster,
        workload=workload_from_config(config, prompt_tokens=prompt_tokens, response_mean=response_mean,
                                      response_std=response_std),
        profile=profile,
        checkpointing={r: config.models[r].gradient_checkpointing for r in models},
        shard_optimizer={r: config.models[r].shard_optimizer for r in models},
        offload_optimizer={r: config.models[r].offload_optimizer for r in models},
        offload={r: config.models[r].offload for r in models},
        kv_cache_bytes=kv * 2**30 if kv > 0 else None,
        kv_block_size=config.generation.kv_block_size,
        transposed_weights=config.generation.transposed_weights,
        iterations=iterations,
    )


def describe_models(problem: Problem) -> list[str]:
    return [f"{role}: {cfg.architecture}, {cfg.num_params() / 1e9:.2f}B parameters, {cfg.num_layers} layers"
            for role, cfg in problem.models.items()]

