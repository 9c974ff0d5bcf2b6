"""Everything a run needs, read and checked before any rank starts.

Config errors (unknown keys, wrong types) come from ``load_config``; here come the ones that need
files: model configs, the plan against the graph and the devices, the dataset's existence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardflow.config.model import ModelConfig
from shardflow.config.settings import ExperimentConfig
from shardflow.plan.execution_plan import ExecutionPlan, symmetric_plan
from shardflow.rl.graph import Graph, Kind
from shardflow.rl.graphs import build_graph
from shardflow.runtime.adaptive import check_adaptive

# Which model kind each role needs: a value head for critics and reward models.
VALUE_ROLES = ("critic", "reward")


@dataclass(frozen=True)
class Prepared:
    config: ExperimentConfig
    graph: Graph
    models: dict[str, ModelConfig]
    plan: ExecutionPlan
    backend: str


def resolve_backend(config: ExperimentConfig) -> str:
    if config.run.backend != "auto":
        return config.run.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def prepare(config: ExperimentConfig) -> Prepared:
    graph = build_graph(config)
    models: dict[str, ModelConfig] = {}
    for role in graph.models():
        spec = config.models[role]
        cfg = ModelConfig.from_pretrained(Path(spec.path))
        if role in VALUE_ROLES and not cfg.value_head:
            raise ValueError(f"models.{role} must be a value model (a *ForSequenceClassification checkpoint "
                             f"with num_labels=1); {spec.path} is {cfg.architecture}")
        if role not in VALUE_ROLES and cfg.value_head:
            raise ValueError(f"models.{role} must be a causal LM; {spec.path} is {cfg.architecture}")
        models[role] = cfg
    if "ref" in models and models["ref"].vocab_size != models["actor"].vocab_size:
        raise ValueError("models.ref and models.actor have different vocabularies")

    devices = config.run.devices
    backend = resolve_backend(config)
    if backend == "nccl" and torch.cuda.device_count() < devices:
        raise ValueError(f"run.devices={devices} but this machine has {torch.cuda.device_count()} GPUs")
    if config.plan == "symmetric":
        plan = symmetric_plan(graph, devices)
    else:
        plan = ExecutionPlan.load(config.plan)
    plan.validate(graph, models, devices)
    for call in graph.model_calls():
        if call.kind is Kind.GENERATE:
            check_adaptive(call.name, plan[call.name], config.generation)
    if plan.num_devices() < devices:
        unused = list(range(plan.num_devices(), devices))
        raise ValueError(f"the plan uses {plan.num_devices()} devices but run.devices={devices}; "
                         f"device(s) {unused} would sit idle")

    data = Path(config.data.path)
    if not data.is_file():
        raise FileNotFoundError(f"data.path {data} does not exist")
    if data.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"data.path must be a .jsonl or .parquet file, got {data.name}")
    return Prepared(config, graph, models, plan, backend)
