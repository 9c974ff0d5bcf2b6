"""Every check of a run's settings across fields, and of what they name, before any rank starts.

Keys, types and single-field rules are checked when the settings are built (``config.load``);
here come the rules that tie fields together (``check_config``) and those that need the files the
settings name (``prepare``): model configs against their roles, the plan against the graph and
the devices, the dataset, the reward function. Errors name the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from shardflow.config.experiment import ExperimentConfig
from shardflow.config.files import read_json
from shardflow.config.model import ModelConfig
from shardflow.data.prompts import Prompt, load_prompts
from shardflow.plan.execution_plan import ExecutionPlan, symmetric_plan
from shardflow.rl.algorithms import algorithm_named
from shardflow.rl.algorithms.base import Algorithm, check_knobs
from shardflow.rl.envs import check_env
from shardflow.rl.envs.tools import load_tools, tool_schema
from shardflow.rl.graph import Graph, Kind
from shardflow.rl.rewards import reward_function, reward_kind
from shardflow.runtime import checkpointing
from shardflow.runtime.calls.rollouts import env_spec, episode_output_limit

# Which model kind each role needs: a value head for critics and reward models.
VALUE_ROLES = ("critic", "reward")


@dataclass(frozen=True)
class Prepared:
    """Everything a run needs, read and checked before any rank starts."""

    config: ExperimentConfig
    algorithm: Algorithm
    graph: Graph
    models: dict[str, ModelConfig]
    plan: ExecutionPlan
    backend: str
    prompts: list[Prompt]  # the dataset, read, checked and tokenized
    resume_dir: Path | None = None  # the checkpoint the run continues from
    resume_iteration: int = 0  # its iteration (0: a fresh start)


class Checked(NamedTuple):
    config: ExperimentConfig  # with the algorithm's knobs resolved (no None left that the run reads)
    algorithm: Algorithm
    graph: Graph


def check_config(config: ExperimentConfig) -> Checked:
    """The rules across settings that need no file; resolves the algorithm's knobs."""
    algorithm = algorithm_named(config.algorithm.name)
    user = config.algorithm
    config = algorithm.resolve(config)
    algo = config.algorithm
    reward_kind(config.reward.kind)
    if algo.batch_size % algo.mini_batches:
        raise ValueError(f"algorithm.mini_batches ({algo.mini_batches}) must divide algorithm.batch_size "
                         f"({algo.batch_size})")
    if algo.kl.target > 0 and algo.kl.coef <= 0:
        raise ValueError(f"algorithm.kl.target needs a positive algorithm.kl.coef to start from, got {algo.kl.coef}")
    algorithm.check(config)
    graph = algorithm.graph(config)
    check_knobs(algorithm, user, config, graph)
    need = list(graph.models())
    for role in need:
        if role not in config.models:
            raise ValueError(f"models.{role} is required (algorithm {algo.name}, kl.coef {algo.kl.coef}, "
                             f"reward {config.reward.kind})")
        if not config.models[role].path:
            raise ValueError(f"models.{role}.path is required")
    extra = sorted(set(config.models) - set(need))
    if extra:
        raise ValueError(f"models {extra} are not used by this configuration (needed: {need})")
    for role in graph.trained_models():
        optim = config.models[role].optim
        steps = optim.total_steps or config.total_updates
        if optim.schedule != "constant" and steps <= optim.warmup_steps:
            raise ValueError(f"models.{role}.optim.schedule {optim.schedule!r} decays after the warm-up, but the "
                             f"run has {steps} optimizer step(s) and warmup_steps={optim.warmup_steps}")
    if not config.data.path:
        raise ValueError("data.path is required")
    check_rollout(config, algorithm)
    return Checked(config, algorithm, graph)


def check_context(config: ExperimentConfig, actor: ModelConfig) -> None:
    """A prompt and its longest response (or episode) must fit the actor's context."""
    output = episode_output_limit(config)
    limit = "rollout.max_tokens_per_episode" if config.rollout.env else "generation.max_new_tokens"
    if config.data.max_prompt_tokens + output + 1 > actor.max_position_embeddings:
        raise ValueError(f"data.max_prompt_tokens ({config.data.max_prompt_tokens}) + {limit} ({output}) exceed "
                         f"models.actor's context of {actor.max_position_embeddings} positions; lower one of them")


def check_rollout(config: ExperimentConfig, algorithm: Algorithm) -> None:
    """Episodes, the worker pool and the reward kinds that need them."""
    rollout, reward = config.rollout, config.reward
    if reward.kind == "none" and not rollout.env:
        raise ValueError("reward.kind=none leaves the rewards to an environment; set rollout.env")
    if reward.kind != "weighted" and reward.terms:
        raise ValueError(f"reward.terms are summed by reward.kind=weighted, not by kind={reward.kind!r}")
    if reward.kind == "weighted" and not reward.terms:
        raise ValueError("reward.kind=weighted needs reward.terms (e.g. reward.terms.correct.kind=math)")
    if not rollout.env:
        if rollout.tools:
            raise ValueError("rollout.tools are used by rollout.env=tools; set it (or drop the tools)")
        return
    if not algorithm.online:
        raise ValueError(f"rollout.env is for algorithms that generate; {algorithm.name} learns from data.path")
    if rollout.workers < 1:
        raise ValueError("rollout.env runs its environments in worker processes: rollout.workers must be >= 1")
    check_env(env_spec(config))


def resolve_backend(config: ExperimentConfig) -> str:
    if config.run.backend != "auto":
        return config.run.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def model_configs(config: ExperimentConfig, graph: Graph) -> dict[str, ModelConfig]:
    """Each role's model config, checked against what the role needs."""
    models: dict[str, ModelConfig] = {}
    for role in graph.models():
        spec = config.models[role]
        cfg = ModelConfig.from_pretrained(spec.path, key=f"models.{role}.path")
        if role in VALUE_ROLES and not cfg.value_head:
            raise ValueError(f"models.{role} must be a value model (a *ForSequenceClassification checkpoint "
                             f"with num_labels=1); {spec.path} is {cfg.architecture}")
        if role not in VALUE_ROLES and cfg.value_head:
            raise ValueError(f"models.{role} must be a causal LM; {spec.path} is {cfg.architecture}")
        models[role] = cfg
    if "ref" in models and models["ref"].vocab_size != models["actor"].vocab_size:
        raise ValueError("models.ref and models.actor have different vocabularies")
    return models


def check_plan(config: ExperimentConfig, graph: Graph, models: dict[str, ModelConfig]) -> ExecutionPlan:
    devices = config.run.devices
    plan = symmetric_plan(graph, devices) if config.plan == "symmetric" else ExecutionPlan.load(config.plan)
    plan.validate(graph, models, devices)
    if plan.num_devices() < devices:
        unused = list(range(plan.num_devices(), devices))
        raise ValueError(f"the plan uses {plan.num_devices()} devices but run.devices={devices}; "
                         f"device(s) {unused} would sit idle")
    if config.generation.adaptive.enabled:
        for call in graph.model_calls():
            if call.kind is Kind.GENERATE and not plan[call.name].tp_targets:
                raise ValueError(f"generation.adaptive.enabled is on, but the plan gives {call.name!r} no "
                                 f"tp_targets (layouts merging replicas of {plan[call.name].layout}, e.g. from "
                                 "split_replicas)")
    return plan


def prepare(config: ExperimentConfig) -> Prepared:
    config, algorithm, graph = check_config(config)
    models = model_configs(config, graph)
    backend = resolve_backend(config)
    if backend == "nccl" and torch.cuda.device_count() < config.run.devices:
        raise ValueError(f"run.devices={config.run.devices} but this machine has {torch.cuda.device_count()} GPUs")
    plan = check_plan(config, graph, models)
    if algorithm.online:
        check_context(config, models["actor"])
    data = Path(config.data.path)
    if not data.is_file():
        raise FileNotFoundError(f"data.path {data} does not exist")
    if data.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"data.path must be a .jsonl or .parquet file, got {data.name}")
    reward = reward_kind(config.reward.kind)
    if reward.model is None and algorithm.online:
        reward_function(config.reward)  # a user's function that cannot be imported fails here, not on the ranks
    tokenizer = AutoTokenizer.from_pretrained(config.models["actor"].path)
    completions = tuple(getattr(config.data, key) for key in algorithm.completions)
    tools = [tool_schema(fn) for fn in load_tools(list(config.rollout.tools)).values()]
    needs_answer = algorithm.online and reward.model is None and config.reward.kind != "none"
    prompts = load_prompts(config.data, tokenizer, require_answer=needs_answer, completions=completions,
                           tools=tools, keep_rows=bool(config.rollout.env))
    resume_dir = check_resume(config, graph, plan)
    return Prepared(config, algorithm, graph, models, plan, backend, prompts, resume_dir,
                    checkpointing.iteration_of(resume_dir) if resume_dir is not None else 0)


def check_resume(config: ExperimentConfig, graph: Graph, plan: ExecutionPlan) -> Path | None:
    """The checkpoint to continue from (None: a fresh start). Its optimizer state is sliced by the
    layout it was saved under, so a plan that trains a model in another layout is refused."""
    latest = checkpointing.latest(config.run.output_dir) if config.run.resume else None
    if latest is None:
        return None
    saved = read_json(latest / "state.json", "checkpoint state").get("layouts", {})
    for role, layout in saved.items():
        now = str(plan[graph.home_call(role).name].layout)
        if role in graph.models() and layout != now:
            raise ValueError(f"run.resume: the checkpoint {latest} holds models.{role}'s optimizer state in layout "
                             f"{layout}, but the plan trains it in {now}; resume with that layout, or set "
                             "run.resume=false to start afresh")
    return latest
