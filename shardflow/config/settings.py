"""Experiment configuration: keyword-only dataclasses, read from YAML plus dotted overrides.

Every field has a default and one line of help. Errors name the key: an unknown key (with the
closest known one), a value of the wrong type, a value out of range. Cross-field checks that need
model configs or the plan (tp divides heads, the plan covers every call) run in
``shardflow.runtime.validate`` before any rank starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = _f(1e-6, "peak learning rate")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.999, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    schedule: str = _f("constant", "learning-rate schedule after warm-up: constant | linear | cosine",
                       )
    warmup_steps: int = _f(0, "optimizer steps of linear warm-up from 0")
    min_lr_ratio: float = _f(0.0, "final learning rate of linear/cosine decay, as a fraction of lr")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 disables)")

    def check(self, where: str) -> None:
        _choice(f"{where}.schedule", self.schedule, ("constant", "linear", "cosine"))
        _positive(f"{where}.lr", self.lr, allow_zero=True)


@dataclass(kw_only=True)
class ModelSpec:
    path: str = _f("", "Hugging Face checkpoint directory")
    dtype: str = _f("auto", "compute dtype: auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward (trained models)")
    compile: bool = _f(True, "torch.compile the decoder layers for training and inference on GPUs")
    offload: bool = _f(False, "keep a frozen model's weights in CPU memory between its calls")
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "optimizer (trained models)"})

    def check(self, where: str) -> None:
        if not self.path:
            raise ValueError(f"{where}.path is required")
        _choice(f"{where}.dtype", self.dtype, ("auto", "bfloat16", "float32"))
        self.optim.check(f"{where}.optim")


@dataclass(kw_only=True)
class DataConfig:
    path: str = _f("", "prompt dataset: .jsonl or .parquet")
    prompt_key: str = _f("prompt", "field with the prompt text")
    messages_key: str = _f("messages", "field with chat messages (used when present)")
    answer_key: str = _f("answer", "field with the reference answer, passed to the reward")
    chat_template: bool = _f(True, "wrap plain prompts as a user message and apply the tokenizer's chat template")
    max_prompt_tokens: int = _f(512, "prompts longer than this are refused")
    shuffle: bool = _f(True, "shuffle each epoch (seeded by run.seed)")

    def check(self, where: str) -> None:
        if not self.path:
            raise ValueError(f"{where}.path is required")
        _positive(f"{where}.max_prompt_tokens", self.max_prompt_tokens)


# torch.compile modes of the decode step that leave CUDA graphs to the engine (which captures its own)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# BLAS libraries the decode step's products can run under on GPUs
BLAS_LIBRARIES = ("cublas", "cublaslt")


@dataclass(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = _f(256, "response length limit")
    samples_per_prompt: int = _f(1, "responses per prompt (the group size of GRPO)")
    temperature: float = _f(1.0, "sampling temperature (0 = greedy)")
    top_p: float = _f(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = _f(0, "sample among the k most likely tokens (0 = off)")
    stop_token_ids: list = _f([], "token ids that end a response besides the tokenizer's EOS")
    kv_cache_gb: float = _f(0.0, "KV cache budget per rank in GiB (0 = a default share of free memory)")
    force_length: bool = _f(False, "ignore EOS and stop tokens: every response gets max_new_tokens (benchmarks)")
    compile: bool = _f(True, "torch.compile the decode step on GPUs (tp=1 layouts; sampling is compiled always)")
    compile_mode: str = _f("default", "torch.compile mode of the decode step: default | max-autotune-no-cudagraphs "
                                      "(autotuned kernels; much longer compilation)")
    blas_library: str = _f("", "BLAS library of the decode step's products on GPUs: cublas | cublaslt "
                               "(empty: torch's default)")
    transposed_weights: bool = _f(False, "decode products read their weights stored transposed on GPUs: other cuBLAS "
                                         "kernels (1-3% faster steps on H200), for a copy of o, down and the LM head")
    share_prompt_kv: bool = _f(True, "decode attention on GPUs reads a prompt's KV once for all its samples (fewer "
                                     "bytes by the prompt's share of the context; its attention 0.90x as long on "
                                     "the GRPO benchmark's shape, H200)")
    adaptive_tp: bool = _f(False, "switch generation to the plan's tp_targets mid-decode when that is predicted to pay")
    adaptive_interval: int = _f(32, "adaptive TP: decode steps between switch decisions")
    adaptive_margin: float = _f(0.25, "adaptive TP: switch when the predicted saving exceeds the switch cost by "
                                      "this fraction of it")
    adaptive_kv: str = _f("auto", "adaptive TP: KV caches of moved requests: auto (cost model) | migrate | recompute")
    adaptive_step_times: str = _f("", "adaptive TP: decode step times, a profile from 'shardflow profile' or "
                                      "bench/adaptive_tp.py's decode_steps.json; empty: the roofline")

    def check(self, where: str) -> None:
        _positive(f"{where}.adaptive_interval", self.adaptive_interval)
        _positive(f"{where}.adaptive_margin", self.adaptive_margin, allow_zero=True)
        _choice(f"{where}.adaptive_kv", self.adaptive_kv, ("auto", "migrate", "recompute"))
        _choice(f"{where}.compile_mode", self.compile_mode, COMPILE_MODES)
        if self.blas_library and self.blas_library not in BLAS_LIBRARIES:
            raise ValueError(f"{where}.blas_library must be empty or one of {', '.join(BLAS_LIBRARIES)}; "
                             f"got {self.blas_library!r}")
        _positive(f"{where}.max_new_tokens", self.max_new_tokens)
        _positive(f"{where}.samples_per_prompt", self.samples_per_prompt)
        _positive(f"{where}.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        _positive(f"{where}.top_k", self.top_k, allow_zero=True)


@dataclass(kw_only=True)
class RewardConfig:
    kind: str = _f("math", "math (verify the answer) | function (module:function) | model (models.reward)")
    function: str = _f("", "for kind=function: 'package.module:function' called with (prompts, responses, answers)")
    answer_pattern: str = _f("", "for kind=math: optional regex whose first group holds the answer")

    def check(self, where: str) -> None:
        _choice(f"{where}.kind", self.kind, ("math", "function", "model"))
        if self.kind == "function" and ":" not in self.function:
            raise ValueError(f"{where}.function must look like 'module:function', got {self.function!r}")


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = _f("grpo", "grpo | ppo")
    batch_size: int = _f(8, "prompts per iteration")
    epochs: int = _f(1, "passes of each train call over the iteration's batch")
    mini_batches: int = _f(1, "optimizer steps per pass")
    micro_batch_tokens: int = _f(8192, "tokens per micro-batch, padding included (inference and training)")
    share_prompts: bool = _f(True, "inference and training run a prompt's tokens once for all its samples "
                                   "where that saves 5% of the tokens or more (packed rows; the same outputs)")
    clip_eps: float = _f(0.2, "policy ratio clip (lower side)")
    clip_eps_high: float = _f(0.0, "policy ratio clip, upper side (0 = same as clip_eps)")
    value_clip: float = _f(0.2, "PPO value clip around the old values (0 disables)")
    kl_coef: float = _f(0.0, "KL(actor || ref) coefficient; 0 drops the reference model")
    kl_in_reward: bool = _f(False, "KL as a per-token reward penalty (PPO classic) instead of a loss term")
    kl_estimator: str = _f("k3", "k1 | k2 | k3 (Schulman's estimators)")
    adaptive_kl_target: float = _f(0.0, "adapt kl_coef towards this KL per sequence (0 = fixed coefficient)")
    adaptive_kl_horizon: int = _f(10000, "samples over which the adaptive KL controller reacts")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    whiten_advantages: bool = _f(True, "PPO: normalise advantages over the batch")
    group_std_normalize: bool = _f(True, "GRPO: divide group-centred rewards by the group's std")
    loss_agg: str = _f("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum")

    def check(self, where: str) -> None:
        _choice(f"{where}.name", self.name, ("grpo", "ppo"))
        _choice(f"{where}.kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _choice(f"{where}.loss_agg", self.loss_agg, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
        for key in ("batch_size", "epochs", "mini_batches", "micro_batch_tokens", "adaptive_kl_horizon"):
            _positive(f"{where}.{key}", getattr(self, key))
        if self.batch_size % self.mini_batches:
            raise ValueError(f"{where}.mini_batches ({self.mini_batches}) must divide batch_size ({self.batch_size})")
        if self.kl_in_reward and self.name != "ppo":
            raise ValueError(f"{where}.kl_in_reward needs a per-token reward, i.e. name=ppo (got {self.name!r})")
        if self.adaptive_kl_target > 0 and self.kl_coef <= 0:
            raise ValueError(f"{where}.adaptive_kl_target needs a positive kl_coef to start from, got {self.kl_coef}")


@dataclass(kw_only=True)
class RunConfig:
    name: str = _f("run", "run name (used in out_dir)")
    out_dir: str = _f("runs/{name}", "where metrics, checkpoints and pictures go")
    iterations: int = _f(10, "RL iterations")
    devices: int = _f(1, "ranks to spawn on this machine (GPUs when CUDA is present, else CPU processes)")
    backend: str = _f("auto", "auto | gloo | nccl")
    seed: int = _f(0, "seed for data order, sampling and initialisation")
    save_every: int = _f(0, "checkpoint every N iterations (0 = only at the end)")
    checkpoints: bool = _f(True, "write checkpoints at all (false: metrics only, as benchmarks do)")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep")
    resume: bool = _f(True, "continue from the latest checkpoint in out_dir when one exists")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    progress: bool = _f(True, "show progress bars")

    def check(self, where: str) -> None:
        _positive(f"{where}.iterations", self.iterations)
        _positive(f"{where}.devices", self.devices)
        _choice(f"{where}.backend", self.backend, ("auto", "gloo", "nccl"))

    @property
    def output_dir(self) -> Path:
        return Path(self.out_dir.format(name=self.name))


@dataclass(kw_only=True)
class ExperimentConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"help": "RL algorithm"})
    models: dict = _f({}, "model roles (actor, critic, ref, reward) to model specs")
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "prompt dataset"})
    generation: GenerationConfig = field(default_factory=GenerationConfig, metadata={"help": "sampling"})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "reward"})
    plan: str = _f("symmetric", "execution plan: 'symmetric', or a plan YAML file")
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "run control"})

    def check(self) -> None:
        """Single-field and config-only cross-field checks (no files read)."""
        self.algorithm.check("algorithm")
        self.data.check("data")
        self.generation.check("generation")
        self.reward.check("reward")
        self.run.check("run")
        for role, spec in self.models.items():
            spec.check(f"models.{role}")
        need = ["actor"]
        if self.algorithm.name == "ppo":
            need.append("critic")
        if self.algorithm.kl_coef > 0 or self.algorithm.adaptive_kl_target > 0:
            need.append("ref")
        if self.reward.kind == "model":
            need.append("reward")
        for role in need:
            if role not in self.models:
                raise ValueError(f"models.{role} is required (algorithm {self.algorithm.name}, "
                                 f"kl_coef {self.algorithm.kl_coef}, reward {self.reward.kind})")
        extra = set(self.models) - set(need)
        if extra:
            raise ValueError(f"models {sorted(extra)} are not used by this configuration (needed: {need})")


# ----- loading ---------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None) -> ExperimentConfig:
    """Read YAML (or start from ``base``), apply ``key.sub=value`` overrides, build and check."""
    raw: dict[str, Any] = dict(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        raw = _merge(raw, loaded)
    for item in overrides:
        raw = _merge(raw, parse_override(item))
    config = build(ExperimentConfig, raw, "")
    config.check()
    return config


def parse_override(item: str) -> dict[str, Any]:
    """``"a.b.c=3"`` -> ``{"a": {"b": {"c": 3}}}`` (the value is read as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, _, text = item.partition("=")
    value = yaml.safe_load(text) if text else ""
    for part in reversed(key.strip().split(".")):
        if not part:
            raise ValueError(f"override {item!r} has an empty key part")
        value = {part: value}
    return value


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build(cls: type, raw: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking keys and types."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {(where + '.' if where else '') + close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {name!r}{hint}")
        kwargs[key] = _convert(hints[key], value, name)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, name)
    if hint is dict and name.endswith("models") and name.count(".") == 0:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must map roles to model specs, got {value!r}")
        return {role: build(ModelSpec, spec, f"{name}.{role}") for role, spec in value.items()}
    expected = hint if isinstance(hint, type) else None
    if isinstance(hint, types.UnionType):
        expected = tuple(a for a in typing.get_args(hint) if isinstance(a, type))
    if expected is float and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    if expected is not None and (not isinstance(value, expected) or (isinstance(value, bool) and expected in (int, float))):
        names = expected.__name__ if isinstance(expected, type) else " | ".join(t.__name__ for t in expected)
        raise ValueError(f"config key {name!r} must be {names}, got {value!r}")
    return value


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")


def describe(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """One line per key with its default and help, for ``shardflow train --help-config``."""
    lines = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            lines.extend(describe(hint, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{key} = {default!r}  # {f.metadata.get('help', '')}")
    return lines
