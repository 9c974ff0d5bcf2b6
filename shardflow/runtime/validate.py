"""Every check of a run's settings across fields, and of what they name, before any rank starts.

Keys, types and single-field rules are checked when the settings are built (``config.load``);
here come the rules that tie fields together (``check_config``) and those that need the files the
settings name (``prepare``): model configs against their roles, the plan against the graph and
the devices, the dataset, the reward function. Errors name the key and the value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoTokenizer

from shardflow.config.experiment import ExperimentConfig, ModelSpec
from shardflow.config.files import read_json
from shardflow.config.model import ModelConfig
from shardflow.data.prompts import Prompt, load_prompts
from shardflow.data.sources import Source, check_source, source_of
from shardflow.models.packed_attention import check_kernel
from shardflow.plan.execution_plan import ExecutionPlan, symmetric_plan
from shardflow.plan.memory import rank_params
from shardflow.rl.algorithms import algorithm_named
from shardflow.rl.algorithms.base import Algorithm, check_knobs
from shardflow.rl.envs import check_env
from shardflow.rl.envs.tools import load_tools, tool_schema
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.graphs import reward_call
from shardflow.rl.rewards import reward_function, reward_kind
from shardflow.runtime import checkpointing
from shardflow.runtime.calls.rollouts import env_spec, episode_output_limit
from shardflow.runtime.models import compute_dtype

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
    tokenizer: Any  # the actor's, loaded once here: unpickled, a rank skips transformers' seconds of loading it
    resume_dir: Path | None = None  # the checkpoint the run continues from
    resume_iteration: int = 0  # its iteration (0: a fresh start)
    eval_prompts: list[Prompt] = ()  # the held-out prompts (eval.path or eval.dataset)


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
    trained = set(graph.trained_models())
    for role in sorted(set(need) - trained):
        if config.models[role].offload_optimizer:
            raise ValueError(f"models.{role}.offload_optimizer: {role} is not trained here and has no optimizer "
                             "(models.<role>.offload keeps a frozen model's weights in host memory)")
    for role in sorted(trained):
        if config.models[role].offload:
            raise ValueError(f"models.{role}.offload is for frozen models; {role} is trained (its optimizer state "
                             f"goes to host memory with models.{role}.offload_optimizer)")
    for role in graph.trained_models():
        optim = config.models[role].optim
        steps = optim.total_steps or config.total_updates
        if optim.schedule != "constant" and steps <= optim.warmup_steps:
            raise ValueError(f"models.{role}.optim.schedule {optim.schedule!r} decays after the warm-up, but the "
                             f"run has {steps} optimizer step(s) and warmup_steps={optim.warmup_steps}")
    if bool(config.data.path) == bool(config.data.dataset):
        raise ValueError("data.path or data.dataset is required (one of them, not both)")
    check_kernel(algo.packed_attention)
    check_rollout(config, algorithm)
    check_eval(config, algorithm.online)
    return Checked(config, algorithm, graph)


def check_eval(config: ExperimentConfig, generates: bool) -> None:
    """Held-out evaluation runs the generate call: it needs one, within the engine's lengths."""
    ev = config.eval
    if not ev.enabled:
        return
    if ev.path and ev.dataset:
        raise ValueError("eval.path or eval.dataset names the held-out prompts (one of them, not both)")
    if not generates:
        raise ValueError(f"eval.* evaluates generated responses, and algorithm {config.algorithm.name} has no generate "
                         "call; evaluate its checkpoints with 'shardflow eval CONFIG --checkpoint DIR'")
    if ev.max_new_tokens > config.generation.max_new_tokens:
        raise ValueError(f"eval.max_new_tokens ({ev.max_new_tokens}) must not exceed generation.max_new_tokens "
                         f"({config.generation.max_new_tokens}), which sizes the generation engine")


def eval_source(config: ExperimentConfig) -> Source:
    return source_of(config.eval, "eval", allow_download=config.data.allow_download)


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


def host_available_bytes() -> int | None:
    """Memory the host can still give (MemAvailable of /proc/meminfo), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(config: ExperimentConfig, graph: Graph, models: dict[str, ModelConfig], plan: ExecutionPlan,
                      device: torch.device, available: int | None) -> None:
    """What the run keeps in host memory (offloaded optimizer state of trained models, offloaded
    weights of frozen ones), over all ranks of this machine, must fit in ``available`` bytes:
    pinning more fails late or takes the machine down."""
    if available is None:
        return
    needed: dict[str, float] = {}
    for role in graph.models():
        spec, cfg = config.models[role], models[role]
        layout = plan[graph.home_call(role).name].layout
        params = rank_params(cfg, layout.pp, layout.tp) * len(layout.ranks)  # summed over the ranks
        if spec.offload_optimizer and role in graph.trained_models():
            needed[f"models.{role}.offload_optimizer"] = 12 * params / (layout.dp if spec.shard_optimizer else 1)
        elif spec.offload and role not in graph.trained_models():
            needed[f"models.{role}.offload"] = params * compute_dtype(spec, device).itemsize
    total = sum(needed.values())
    if total > 0.9 * available:
        parts = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in needed.items())
        raise ValueError(f"host memory: the run would keep {total / 2**30:.1f} GiB there ({parts}) but "
                         f"{available / 2**30:.1f} GiB are available; shard the optimizer over more "
                         "data-parallel replicas (models.<role>.shard_optimizer) or offload less")


def prepare(config: ExperimentConfig) -> Prepared:
    config, algorithm, graph = check_config(config)
    models = model_configs(config, graph)
    backend = resolve_backend(config)
    if backend == "nccl" and torch.cuda.device_count() < config.run.devices:
        raise ValueError(f"run.devices={config.run.devices} but this machine has {torch.cuda.device_count()} GPUs")
    plan = check_plan(config, graph, models)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    check_host_memory(config, graph, models, plan, device, host_available_bytes())
    if algorithm.online:
        check_context(config, models["actor"])
    check_source(source_of(config.data, "data"))
    if config.eval.enabled:
        check_source(eval_source(config))
    check_loggers(config)
    reward = reward_kind(config.reward.kind)
    if reward.model is None and algorithm.online:
        reward_function(config.reward)  # a user's function that cannot be imported fails here, not on the ranks
    tokenizer = AutoTokenizer.from_pretrained(config.models["actor"].path)
    completions = tuple(getattr(config.data, key) for key in algorithm.completions)
    prompts = load_prompts(config.data, tokenizer, require_answer=algorithm.online and _needs_answer(config),
                           completions=completions, tools=_tool_schemas(config), keep_rows=bool(config.rollout.env))
    resume_dir = check_resume(config, graph, plan)
    return Prepared(config, algorithm, graph, models, plan, backend, prompts, tokenizer, resume_dir,
                    checkpointing.iteration_of(resume_dir) if resume_dir is not None else 0,
                    eval_prompts=load_eval_prompts(config, tokenizer) if config.eval.enabled else [])


def _needs_answer(config: ExperimentConfig) -> bool:
    """Whether the reward reads each row's reference answer."""
    return reward_kind(config.reward.kind).model is None and config.reward.kind != "none"


def _tool_schemas(config: ExperimentConfig) -> list[dict]:
    return [tool_schema(fn) for fn in load_tools(list(config.rollout.tools)).values()]


def load_eval_prompts(config: ExperimentConfig, tokenizer) -> list[Prompt]:
    """The held-out prompts, read and checked as the training ones (``eval.max_prompts`` first)."""
    prompts = load_prompts(config.data, tokenizer, source=eval_source(config), require_answer=_needs_answer(config),
                           tools=_tool_schemas(config), keep_rows=bool(config.rollout.env))
    return prompts[:config.eval.max_prompts] if config.eval.max_prompts else prompts


# the optional logger packages, by the setting that turns each on
LOGGER_PACKAGES = {"tensorboard": ("run.tensorboard", "tensorboard"), "wandb": ("run.wandb.enabled", "wandb"),
                   "mlflow": ("run.mlflow.enabled", "mlflow")}


def check_loggers(config: ExperimentConfig) -> None:
    """Every logger that is on has its package installed."""
    run = config.run
    wanted = {"tensorboard": run.tensorboard, "wandb": run.wandb.enabled, "mlflow": run.mlflow.enabled}
    for name, on in wanted.items():
        key, package = LOGGER_PACKAGES[name]
        if on and importlib.util.find_spec(package) is None:
            raise ValueError(f"{key} needs the {package} package: pip install {package} (or pip install "
                             f"'shardflow[{name}]'), or turn it off")


def prepare_eval(config: ExperimentConfig, checkpoint: Path | None = None) -> Prepared:
    """What ``shardflow eval`` needs: the generate call and the reward (a graph of their own, in the
    plan's layouts for them or all devices), the actor from ``checkpoint`` when given, and the
    held-out prompts; the training data is not read."""
    if not config.eval.enabled:
        raise ValueError("shardflow eval needs eval.path or eval.dataset (the held-out prompts)")
    check_source(eval_source(config))
    if checkpoint is not None:
        actor = dataclasses.replace(config.models.get("actor", ModelSpec()), path=str(checkpoint_model(checkpoint)))
        config = dataclasses.replace(config, models={**config.models, "actor": actor})
    graph = Graph("eval", (Call("actor_gen", Kind.GENERATE, "actor", ("prompts",), ("responses",)),
                           reward_call(config)))
    for role in graph.models():
        if not config.models.get(role, ModelSpec()).path:
            raise ValueError(f"models.{role}.path is required (or --checkpoint for the actor)")
    config = dataclasses.replace(config, models={role: config.models[role] for role in graph.models()})
    reward_kind(config.reward.kind)
    check_rollout(config, algorithm_named("grpo"))
    models = model_configs(config, graph)
    backend = resolve_backend(config)
    if config.plan == "symmetric":
        plan = symmetric_plan(graph, config.run.devices)
    else:
        full = ExecutionPlan.load(config.plan)
        plan = ExecutionPlan({c.name: full[c.name] for c in graph.model_calls()})
    plan.validate(graph, models, config.run.devices)
    check_context(config, models["actor"])
    if reward_kind(config.reward.kind).model is None:
        reward_function(config.reward)
    tokenizer = AutoTokenizer.from_pretrained(config.models["actor"].path)
    return Prepared(config, algorithm_named(config.algorithm.name), graph, models, plan, backend, [], tokenizer,
                    eval_prompts=load_eval_prompts(config, tokenizer))


def checkpoint_model(path: Path) -> Path:
    """The actor's checkpoint directory of ``path``: a model directory, or a run's checkpoint
    (``iter-N``) that holds one under ``actor/``."""
    if (path / "actor" / "config.json").is_file():
        return path / "actor"
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"--checkpoint {path} holds no model (no config.json, nor actor/config.json)")


def check_resume(config: ExperimentConfig, graph: Graph, plan: ExecutionPlan) -> Path | None:
    """The checkpoint to continue from (None: a fresh start). Any plan and device count can resume
    it (its optimizer state is by tensor name); one written in the per-rank pickle format of
    earlier versions cannot."""
    latest = checkpointing.latest(config.run.output_dir) if config.run.resume else None
    if latest is None:
        return None
    state = read_json(latest / "state.json", "checkpoint state")
    if int(state.get("iteration", 0)) >= config.run.iterations:
        return latest  # nothing left to run: nothing of it is loaded
    if state.get("format", 1) < checkpointing.CHECKPOINT_FORMAT:
        raise ValueError(f"run.resume: the checkpoint {latest} keeps its optimizer state in per-rank pickles (an "
                         "earlier shardflow), which this version does not load; set run.resume=false to start "
                         "afresh")
    for role in graph.trained_models():
        if not (latest / f"{role}-optimizer" / "optimizer.json").is_file():
            raise ValueError(f"run.resume: the checkpoint {latest} holds no optimizer state of models.{role} (was it "
                             "written by another algorithm?); set run.resume=false to start afresh")
    return latest
