"""The experiment's settings tree: one settings class per concern, nested as the YAML is.

``shardflow train --help-config`` lists every key (``schema.describe``). Each field states its
single-field rules; rules across fields (a model the algorithm needs, a schedule that needs more
optimizer steps than its warm-up) are checked in ``runtime.validate`` before any rank starts.
Algorithm and reward kinds are checked there too: their names come from registries above this
package (``rl.algorithms``, ``rl.rewards``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardflow.config.schema import Settings, section, setting

# torch.compile modes of the decode step that leave CUDA graphs to the engine (which captures its own)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# BLAS libraries the decode step's products can run under on GPUs
BLAS_LIBRARIES = ("cublas", "cublaslt")
# Tokens per paged KV block are whole multiples of this (blocks start at aligned positions).
KV_BLOCK_MULTIPLE = 16
LR_SCHEDULES = ("constant", "linear", "cosine")
# how adaptive TP moves the KV caches of requests whose replicas merge
KV_MODES = ("migrate", "recompute")


@dataclass(frozen=True, kw_only=True)
class OptimConfig(Settings):
    lr: float = setting(1e-6, "peak learning rate", gt=0)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay (matrices only, not norms or biases)", ge=0)
    beta1: float = setting(0.9, "AdamW decay rate of the first moment", ge=0, lt=1)
    beta2: float = setting(0.999, "AdamW decay rate of the second moment", ge=0, lt=1)
    eps: float = setting(1e-8, "AdamW epsilon, added to the root of the second moment", gt=0)
    schedule: str = setting("constant", "learning-rate schedule after warm-up", choices=LR_SCHEDULES)
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from lr / warmup_steps to lr", ge=0)
    total_steps: int = setting(0, "optimizer steps that linear and cosine decay span (0: all of the run's)", ge=0)
    min_lr_ratio: float = setting(0.0, "final learning rate of linear and cosine decay, as a fraction of lr",
                                  ge=0, le=1)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 disables)", ge=0)


@dataclass(frozen=True, kw_only=True)
class ModelSpec(Settings):
    path: str = setting("", "Hugging Face checkpoint directory (relative: to the config file)", path="file")
    dtype: str = setting("auto", "compute dtype (auto: bfloat16 on GPU, float32 on CPU)",
                         choices=("auto", "bfloat16", "float32"))
    gradient_checkpointing: bool = setting(False, "recompute activations in backward (trained models)")
    shard_optimizer: bool = setting(False, "split fp32 master weights and AdamW moments over the training call's "
                                           "data-parallel replicas, gradients reduce-scattered to them (1/dp of that "
                                           "state per rank)")
    offload_optimizer: bool = setting(False, "keep a trained model's fp32 master weights and AdamW moments in "
                                             "(pinned) host memory, streamed through the device at each update")
    compile: bool = setting(True, "torch.compile the decoder layers for training and inference on GPUs")
    offload: bool = setting(False, "keep a frozen model's weights in CPU memory between its calls")
    optim: OptimConfig = section(OptimConfig, "optimizer (trained models)")


@dataclass(frozen=True, kw_only=True)
class DataConfig(Settings):
    path: str = setting("", "prompt dataset: a .jsonl or .parquet file, or a directory of a Hugging Face dataset "
                            "(save_to_disk, or data files by split) (relative: to the config file)", path="file")
    dataset: str = setting("", "instead of path: a Hugging Face dataset by name (e.g. openai/gsm8k), from the local "
                               "cache unless allow_download")
    dataset_config: str = setting("", "the dataset's configuration (subset) name, if it has several (e.g. main)")
    split: str = setting("train", "the split of a Hugging Face dataset (directory or name)")
    allow_download: bool = setting(False, "let a dataset by name be downloaded when it is not in the local cache")
    prompt_key: str = setting("prompt", "field with the prompt text")
    messages_key: str = setting("messages", "field with chat messages (used when present)")
    answer_key: str = setting("answer", "field with the reference answer, passed to the reward")
    response_key: str = setting("response", "field with the response a row teaches (algorithm sft)")
    chosen_key: str = setting("chosen", "field with the preferred response (algorithm dpo)")
    rejected_key: str = setting("rejected", "field with the response preferred less (algorithm dpo)")
    chat_template: bool = setting(True, "wrap plain prompts as a user message and apply the tokenizer's chat "
                                        "template")
    max_prompt_tokens: int = setting(512, "prompts longer than this are refused", gt=0)
    shuffle: bool = setting(True, "shuffle each epoch (seeded by run.seed)")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(Settings):
    """Held-out evaluation: prompts of their own through the generate call and the reward, every
    ``every`` iterations and at the end; their columns and prompt length follow ``data``'s keys."""

    path: str = setting("", "held-out prompts: as data.path (empty, and no dataset: no evaluation)", path="file")
    dataset: str = setting("", "instead of path: a Hugging Face dataset by name, as data.dataset")
    dataset_config: str = setting("", "the dataset's configuration (subset) name")
    split: str = setting("test", "the split of a Hugging Face dataset")
    every: int = setting(0, "evaluate every N iterations (0: only at the end)", ge=0)
    at_start: bool = setting(True, "evaluate once before the first iteration too (logged as iteration 0)")
    max_prompts: int = setting(0, "evaluate the first N prompts only (0: all)", ge=0)
    samples: int = setting(4, "sampled responses per prompt for mean@k and pass@k (0: the greedy pass alone)",
                           ge=0)
    temperature: float | None = setting(None, "sampling temperature of the sampled pass (default: "
                                              "generation.temperature)", gt=0)
    max_new_tokens: int = setting(0, "response length limit (0: generation.max_new_tokens; not above it)", ge=0)
    correct_reward: float = setting(1.0, "a response counts as correct (pass@1, pass@k) when its reward is at "
                                         "least this")

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.dataset)


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig(Settings):
    """Adaptive tensor parallelism: the generate call starts in its plan layout and merges
    data-parallel replicas into the plan's ``tp_targets`` mid-decode when that is predicted to pay."""

    enabled: bool = setting(False, "switch generation to the plan's tp_targets mid-decode when predicted to pay")
    interval: int = setting(32, "decode steps between switch decisions", gt=0)
    margin: float = setting(0.25, "switch when the predicted saving exceeds the switch cost by this fraction of it",
                            ge=0)
    min_saving_s: float = setting(0.0, "...and by at least this many seconds", ge=0)
    kv_mode: str = setting("auto", "KV caches of moved requests: auto (the cost model picks per switch), migrate "
                                   "or recompute", choices=("auto", *KV_MODES))
    step_times: str = setting("", "decode step times: a profile from 'shardflow profile' or bench/adaptive_tp.py's "
                                  "decode_steps.json (empty: the roofline)",
                         path="file")
    horizon_points: int = setting(48, "grid points over the remaining decode steps that the policy sums", ge=4)
    switch_points: int = setting(8, "switch times the policy compares: now and the next grid points", ge=1)
    length_buckets: int = setting(32, "buckets summarising unfinished requests by tokens generated", ge=2)
    max_samples: int = setting(8192, "response lengths the length predictor keeps", gt=0)
    prior_weight: float = setting(1.0, "pseudo-samples of the predictor's uniform prior over [1, max_new_tokens]",
                                  ge=0)
    bucket_bytes: int = setting(64 << 20, "KV migration message size per peer and round", ge=1 << 10)


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(Settings):
    max_new_tokens: int = setting(256, "response length limit", gt=0)
    samples_per_prompt: int = setting(1, "responses per prompt (the group size of GRPO)", gt=0)
    temperature: float = setting(1.0, "sampling temperature (0 = greedy)", ge=0)
    top_p: float = setting(1.0, "nucleus sampling threshold (1 = off)", gt=0, le=1)
    top_k: int = setting(0, "sample among the k most likely tokens (0 = off)", ge=0)
    stop_token_ids: list = setting([], "token ids that end a response besides the tokenizer's EOS")
    kv_cache_gb: float = setting(0.0, "KV cache budget per rank in GiB (0 = a default share of free memory)", ge=0)
    force_length: bool = setting(False, "ignore EOS and stop tokens: every response gets max_new_tokens "
                                        "(benchmarks)")
    compile: bool = setting(True, "torch.compile the decode step's layers on GPUs (one compiled layer serves all; "
                                  "tp=1 layouts)")
    compile_ahead: bool = setting(True, "compile the decode step in a helper process while the run sets up (its "
                                        "graphs into the compile cache, where the first generate call finds them)")
    compile_mode: str = setting("default", "torch.compile mode of the decode step (max-autotune-no-cudagraphs: "
                                           "autotuned kernels, much longer compilation)", choices=COMPILE_MODES)
    combo_kernels: bool = setting(True, "the compiled decode step launches independent kernels as one (inductor's "
                                        "combo kernels; fewer launches a layer)")
    blas_library: str = setting("", "BLAS library of the decode step's products on GPUs (empty: torch's default)",
                                choices=("", *BLAS_LIBRARIES))
    transposed_weights: bool = setting(False, "decode products read their weights stored transposed on GPUs (other "
                                              "cuBLAS kernels), for a copy of o, down and the LM head")
    share_prompt_kv: bool = setting(True, "decode attention on GPUs reads a prompt's KV once for all its samples "
                                          "(fewer bytes by the prompt's share of the context)")
    kv_block_size: int = setting(64, "tokens per KV cache block: the cache holds the blocks requests reach, not "
                                     "max_seq_len per request (0 = one contiguous block per request)", ge=0,
                                 multiple_of=KV_BLOCK_MULTIPLE)
    adaptive: AdaptiveConfig = section(AdaptiveConfig, "adaptive tensor parallelism")


REWARD_HELP = ("math (verify the answer), function (module:function), http (reward.url), model "
               "(models.reward), weighted (the sum of reward.terms) or none (an environment's rewards alone)")


@dataclass(frozen=True, kw_only=True)
class RewardTermConfig(Settings):
    """One term of a weighted reward: a function of the texts, scored in the worker pool."""

    kind: str = setting("math", "math, function or http (as reward.kind)", choices=("math", "function", "http"))
    function: str = setting("", "for kind=function: 'package.module:function' or 'file.py:function'",
                            path="function")
    answer_pattern: str = setting("", "for kind=math: optional regex whose first group holds the answer")
    url: str = setting("", "for kind=http: the address the texts are posted to")
    weight: float = setting(1.0, "the term's weight in the sum")


@dataclass(frozen=True, kw_only=True)
class RewardConfig(Settings):
    kind: str = setting("math", REWARD_HELP)
    function: str = setting("", "for kind=function: 'package.module:function' or 'file.py:function' (relative: "
                                "to the config file), called with (prompts, responses, answers)", path="function")
    answer_pattern: str = setting("", "for kind=math: optional regex whose first group holds the answer")
    url: str = setting("", "for kind=http: a server of yours that answers a POST of {prompts, responses, answers} "
                           "(JSON) with {rewards: [...]}")
    terms: dict[str, RewardTermConfig] = setting({}, "for kind=weighted: named terms, each a reward.kind with its "
                                                     "weight (reward.terms.NAME.kind, .weight, ...)")
    error_value: float = setting(0.0, "the reward of a response whose reward function raised or timed out (counted "
                                      "as reward/errors; the run goes on)")
    timeout_s: float = setting(30.0, "longest a reward function may take for one response (in the worker pool)",
                               gt=0)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(Settings):
    """Multi-turn episodes (``rollout.env``) and the worker pool where environments and reward
    functions run beside decoding."""

    env: str = setting("", "a multi-turn environment: 'module:Class' or 'file.py:Class', made per episode with "
                           "the prompt row and stepped with each model turn (empty: one turn, no environment)",
                       path="function")
    tools: list = setting([], "tools for the built-in tool environment (rollout.env=tools): built-in names "
                              "(calculator, python) or 'module:function'", path="function")
    tool_format: str = setting("hermes", "how the model writes tool calls", choices=("hermes",))
    max_turns: int = setting(4, "most model turns per episode", gt=0)
    max_tokens_per_episode: int = setting(1024, "most tokens after the prompt per episode, observations included",
                                          gt=0)
    observation_role: str = setting("tool", "the chat role of an observation's turn")
    episode_reward: str = setting("sum", "an episode's environment reward: the sum over its turns or the last one",
                                  choices=("sum", "last"))
    workers: int = setting(1, "worker processes per holder of rollouts for environments and reward functions "
                              "(0: rewards scored after generation in the rank itself; environments need >= 1)",
                           ge=0)
    step_timeout_s: float = setting(30.0, "longest an environment may take to make or step an episode (one that "
                                          "raises or times out ends it with reward.error_value, counted)", gt=0)
    reproducible: bool = setting(False, "resume episodes at decode steps that depend on the tokens alone, not on how "
                                        "fast their environments answered, so that a seed repeats its run exactly "
                                        "(decoding then waits for slow environments)")


PRESET = "(default: the algorithm's)"
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True, kw_only=True)
class KLConfig(Settings):
    """KL(actor || ref) against a reference model; a coefficient of 0 (and no target) drops the
    reference model from the graph."""

    coef: float = setting(0.0, "KL coefficient (the starting one when adapted)", ge=0)
    in_reward: bool | None = setting(None, "KL as a per-token reward penalty (PPO classic) instead of a loss term "
                                           + PRESET)
    estimator: str | None = setting(None, "Schulman's estimator of the per-token KL " + PRESET,
                                    choices=KL_ESTIMATORS)
    target: float = setting(0.0, "adapt the coefficient towards this KL per sequence, summed over its response "
                                 "tokens (0 = fixed coefficient)", ge=0)
    horizon: int = setting(10000, "samples over which the adaptive controller reacts", gt=0)

    @property
    def used(self) -> bool:
        """Whether the run needs the reference model."""
        return self.coef > 0 or self.target > 0


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig(Settings):
    """DAPO's dynamic sampling: groups whose rewards are all equal teach nothing and are dropped."""

    enabled: bool | None = setting(None, "drop groups whose rewards are all equal and generate more until the "
                                         "batch is full " + PRESET)
    max_rounds: int = setting(4, "generation rounds at most per iteration (the batch may stay short)", gt=0)


@dataclass(frozen=True, kw_only=True)
class OverlongConfig(Settings):
    """DAPO's handling of responses that reach generation.max_new_tokens."""

    buffer: int | None = setting(None, "a soft penalty over the last this many tokens before max_new_tokens, "
                                       "growing linearly to overlong.penalty (0 = off) " + PRESET, ge=0)
    penalty: float = setting(1.0, "the soft penalty at max_new_tokens", ge=0)
    filter: bool | None = setting(None, "responses cut at max_new_tokens take no part in the loss " + PRESET)


@dataclass(frozen=True, kw_only=True)
class DPOConfig(Settings):
    beta: float | None = setting(None, "DPO's inverse temperature on the log-ratio margins " + PRESET, gt=0)
    label_smoothing: float | None = setting(None, "the assumed share of flipped preference labels (conservative "
                                                  "DPO) " + PRESET, ge=0, lt=0.5)
    loss: str | None = setting(None, "sigmoid (DPO) or ipo (IPO's squared loss) " + PRESET,
                               choices=("sigmoid", "ipo"))


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig(Settings):
    """The algorithm by name (``rl.algorithms``): a preset of the knobs below, each of which can
    also be set on its own; a knob the algorithm cannot use is refused before the run starts."""

    name: str = setting("grpo", "the RL algorithm")
    batch_size: int = setting(8, "prompts (or data rows) per iteration", gt=0)
    epochs: int = setting(1, "passes of each train call over the iteration's batch", gt=0)
    mini_batches: int = setting(1, "optimizer steps per pass", gt=0)
    micro_batch_tokens: int | None = setting(None, "tokens per micro-batch, padding included (inference and "
                                                   "training); unset: as many as the device's free memory holds at "
                                                   "each call, at most 32768 (8192 on CPU)", gt=0)
    share_prompts: bool = setting(True, "inference and training run a prompt's tokens once for all its samples "
                                        "where that saves 5% of the tokens or more (packed rows; the same outputs)")
    packed_attention: str = setting("auto", "GPU kernel of shared prompts' attention: rows (each sample a padded row "
                                            "of its prompt and tokens, cuDNN's kernel on Hopper), varlen (flash "
                                            "attention's variable-length kernel, no padding), fa4 (the same through "
                                            "FlashAttention-4, the flash-attn-4 package), auto (fa4 where it is "
                                            "installed and runs, else rows where cuDNN runs and padding costs less "
                                            "than it gains, else varlen)",
                                    choices=("auto", "rows", "varlen", "fa4"))
    advantage: str | None = setting(None, "advantage estimator (rl.advantages) " + PRESET)
    policy_loss: str | None = setting(None, "policy loss (rl.losses): ppo_clip (per token) or gspo (per "
                                            "sequence ratio) " + PRESET)
    loss_agg: str | None = setting(None, "how token losses become the step's loss " + PRESET,
                                   choices=LOSS_AGG_MODES)
    clip_low: float | None = setting(None, "policy ratio clip below 1 " + PRESET, ge=0, lt=1)
    clip_high: float | None = setting(None, "policy ratio clip above 1 (DAPO's clip-higher when above clip_low) "
                                            + PRESET, ge=0)
    dual_clip: float | None = setting(None, "dual clip: the loss of a negative advantage stays below dual_clip x "
                                            "|advantage| (> 1; 0 = off) " + PRESET, ge=0)
    value_clip: float | None = setting(None, "PPO value clip around the old values (0 disables) " + PRESET, ge=0)
    gamma: float | None = setting(None, "discount of per-token rewards " + PRESET, ge=0, le=1)
    lam: float | None = setting(None, "GAE lambda " + PRESET, ge=0, le=1)
    whiten_advantages: bool | None = setting(None, "normalise GAE's advantages over the batch " + PRESET)
    group_std_normalize: bool | None = setting(None, "GRPO: divide group-centred rewards by the group's std "
                                                     + PRESET)
    entropy_coef: float = setting(0.0, "entropy bonus coefficient")
    kl: KLConfig = section(KLConfig, "KL to the reference model")
    dynamic_sampling: DynamicSamplingConfig = section(DynamicSamplingConfig, "DAPO's dynamic sampling")
    overlong: OverlongConfig = section(OverlongConfig, "DAPO's overlong responses")
    dpo: DPOConfig = section(DPOConfig, "DPO's loss")

    @property
    def updates_per_call(self) -> int:
        """Optimizer steps of one train call."""
        return self.epochs * self.mini_batches


@dataclass(frozen=True, kw_only=True)
class WandbConfig(Settings):
    enabled: bool = setting(False, "log metrics, the config and the plan to Weights & Biases (pip install wandb)")
    project: str = setting("shardflow", "the W&B project")
    entity: str = setting("", "the W&B entity (team or user; empty: your default)")
    mode: str = setting("offline", "online (to the server), offline (files under out_dir/wandb, synced later with "
                                   "'wandb sync') or disabled", choices=("online", "offline", "disabled"))
    tags: list = setting([], "tags of the W&B run")


@dataclass(frozen=True, kw_only=True)
class MlflowConfig(Settings):
    enabled: bool = setting(False, "log metrics, the config and the plan to MLflow (pip install mlflow)")
    tracking_uri: str = setting("", "the MLflow tracking server or store (empty: a local store, out_dir/mlflow.db)")
    experiment: str = setting("shardflow", "the MLflow experiment")


@dataclass(frozen=True, kw_only=True)
class RunConfig(Settings):
    name: str = setting("run", "run name (used in out_dir)")
    out_dir: str = setting("runs/{name}", "where metrics, checkpoints and pictures go (relative: to the working "
                                          "directory)")
    iterations: int = setting(10, "RL iterations", gt=0)
    devices: int = setting(1, "ranks to spawn on this machine (GPUs when CUDA is present, else CPU processes)", gt=0)
    backend: str = setting("auto", "process-group backend (auto: nccl with CUDA, else gloo)",
                           choices=("auto", "gloo", "nccl"))
    seed: int = setting(0, "seed for data order, sampling and initialisation")
    save_every: int = setting(0, "checkpoint every N iterations (0 = only at the end)", ge=0)
    checkpoints: bool = setting(True, "write checkpoints at all (false: metrics only, as benchmarks do)")
    keep_checkpoints: int = setting(2, "how many recent checkpoints to keep", gt=0)
    resume: bool = setting(True, "continue from the latest checkpoint in out_dir when one exists")
    tensorboard: bool = setting(True, "write TensorBoard event files")
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases logging")
    mlflow: MlflowConfig = section(MlflowConfig, "MLflow logging")
    progress: bool = setting(True, "show progress bars")
    compile_cache: str = setting("~/.cache/shardflow/compile", "where compiled graphs and kernels are kept between "
                                 "runs on GPUs (empty: torch's defaults under the temporary directory)")

    @property
    def output_dir(self) -> Path:
        return Path(self.out_dir.format(name=self.name))


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig(Settings):
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "the RL algorithm")
    models: dict[str, ModelSpec] = setting({}, "model roles (actor, critic, ref, reward) and their settings")
    data: DataConfig = section(DataConfig, "prompt dataset")
    generation: GenerationConfig = section(GenerationConfig, "sampling")
    reward: RewardConfig = section(RewardConfig, "reward")
    rollout: RolloutConfig = section(RolloutConfig, "multi-turn episodes, tools and the worker pool")
    eval: EvalConfig = section(EvalConfig, "held-out evaluation during training and by 'shardflow eval'")
    plan: str = setting("symmetric", "execution plan: 'symmetric', or a plan YAML file (relative: to the config "
                                     "file)", path="plan")
    run: RunConfig = section(RunConfig, "run control")

    @property
    def total_updates(self) -> int:
        """Optimizer steps of a trained model over the whole run."""
        return self.run.iterations * self.algorithm.updates_per_call


# Keys that moved, with where they are now: an old config gets told rather than guessed at.
RENAMED = {
    "algorithm.clip_eps": "algorithm.clip_low",
    "algorithm.clip_eps_high": "algorithm.clip_high",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.adaptive_kl_target": "algorithm.kl.target",
    "algorithm.adaptive_kl_horizon": "algorithm.kl.horizon",
    "generation.adaptive_tp": "generation.adaptive.enabled",
    "generation.adaptive_interval": "generation.adaptive.interval",
    "generation.adaptive_margin": "generation.adaptive.margin",
    "generation.adaptive_kv": "generation.adaptive.kv_mode",
    "generation.adaptive_step_times": "generation.adaptive.step_times",
}
