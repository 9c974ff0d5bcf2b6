"""What one RL iteration processes, as the cost model sees it.

Response lengths are skewed in RL (most answers end early, a few run to the limit), and that is
what makes generation's active batch shrink. They are modelled as a log-normal with the given mean
and spread, clipped to ``[1, max_new_tokens]`` (the clipped mass is the "clip ratio"). A replica
of ``m`` requests sees the ``m`` order statistics of that distribution (quantiles ``i / (m + 1)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from statistics import NormalDist

from shardflow.config.experiment import ExperimentConfig
from shardflow.config.model import ModelConfig
from shardflow.perf.sharing import MIN_SAVING


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompts: int  # prompts per iteration (algorithm.batch_size)
    samples_per_prompt: int = 1
    prompt_tokens: int  # prompt length (every prompt, the planning assumption)
    max_new_tokens: int
    response_mean: float  # mean response length before clipping
    response_std: float = 0.0
    train_steps: int = 1  # optimizer steps per train call (epochs x mini-batches)
    micro_batch_tokens: int | None = None  # the run's token budget per micro-batch; None: sized by memory
    share_prompts: bool = False  # inference and training run a prompt once for all its samples
    share_prompt_kv: bool = False  # decode attention reads a prompt's KV once for its samples

    def __post_init__(self) -> None:
        for name in ("prompts", "samples_per_prompt", "prompt_tokens", "max_new_tokens", "train_steps",
                     "micro_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.response_mean <= self.max_new_tokens:
            raise ValueError(f"response mean must be in (0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.response_mean}")
        if self.response_std < 0:
            raise ValueError(f"response spread must be non-negative, got {self.response_std}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def max_tokens(self) -> int:
        """Longest sequence: what a KV-cache slot is sized for."""
        return self.prompt_tokens + self.max_new_tokens

    def response_quantile(self, q: float) -> float:
        if self.response_std == 0:
            return min(self.response_mean, self.max_new_tokens)
        s2 = math.log1p((self.response_std / self.response_mean) ** 2)
        mu = math.log(self.response_mean) - s2 / 2
        value = math.exp(mu + math.sqrt(s2) * NormalDist().inv_cdf(q))
        return min(max(value, 1.0), float(self.max_new_tokens))

    def response_lengths(self, m: int) -> tuple[float, ...]:
        """Expected sorted response lengths of ``m`` requests."""
        return _order_statistics(self, m)

    @cached_property
    def _moments(self) -> tuple[float, float]:
        lengths = [self.prompt_tokens + r for r in self.response_lengths(1000)]
        return sum(lengths) / len(lengths), sum(x * x for x in lengths) / len(lengths)

    @property
    def mean_tokens(self) -> float:
        """Mean sequence length (prompt + response)."""
        return self._moments[0]

    @property
    def model_tokens(self) -> float:
        """Tokens per sequence that inference and training run through the layers: with shared
        prompts, a group's prompt once for its samples (where the runtime shares: see
        ``engine.shared_prompts.MIN_SAVING``)."""
        saved = self.prompt_tokens * (1 - 1 / self.samples_per_prompt) if self.share_prompts else 0.0
        return self.mean_tokens - saved if saved >= MIN_SAVING * self.mean_tokens else self.mean_tokens

    def model_tokens_of(self, cfg: ModelConfig) -> float:
        """``model_tokens`` for a model of shape ``cfg``: the runtime shares no prompt in a model with
        a sliding window anywhere."""
        return self.mean_tokens if any(cfg.sliding_windows) else self.model_tokens

    def response_share_of(self, cfg: ModelConfig) -> float:
        """Response tokens / model tokens of ``cfg``: the share of positions where RL calls run the LM head."""
        return (self.mean_tokens - self.prompt_tokens) / self.model_tokens_of(cfg)

    @property
    def attention_length(self) -> float:
        """Length whose causal attention cost, per token, equals the batch's: E[L^2] / E[L]."""
        mean, square = self._moments
        return square / mean

    @property
    def tokens(self) -> float:
        """Tokens (prompt + response) per iteration."""
        return self.sequences * self.mean_tokens

    @property
    def clip_ratio(self) -> float:
        if self.response_std == 0:
            return 1.0 if self.response_mean >= self.max_new_tokens else 0.0
        s2 = math.log1p((self.response_std / self.response_mean) ** 2)
        mu = math.log(self.response_mean) - s2 / 2
        return 1 - NormalDist().cdf((math.log(self.max_new_tokens) - mu) / math.sqrt(s2))

    def describe(self) -> str:
        return (f"{self.sequences} sequences ({self.prompts} prompts x {self.samples_per_prompt}), prompt "
                f"{self.prompt_tokens} tokens, response mean {self.response_mean:.0f} spread {self.response_std:.0f} "
                f"(max {self.max_new_tokens}, clipped {self.clip_ratio:.0%}), {self.train_steps} optimizer "
                "step(s) per train call")


@lru_cache(maxsize=1024)
def _order_statistics(w: Workload, m: int) -> tuple[float, ...]:
    return tuple(w.response_quantile(i / (m + 1)) for i in range(1, m + 1))


def workload_from_config(config: ExperimentConfig, *, prompt_tokens: int | None = None,
                         response_mean: float | None = None, response_std: float | None = None) -> Workload:
    """The workload of an experiment. Prompts are taken at ``data.max_prompt_tokens`` unless given;
    responses default to mean max_new_tokens / 2 and spread max_new_tokens / 4 (all at the limit
    with ``generation.force_length``)."""
    gen, algo = config.generation, config.algorithm
    if gen.force_length:
        mean, std = float(gen.max_new_tokens), 0.0
    else:
        mean = gen.max_new_tokens / 2 if response_mean is None else float(response_mean)
        std = gen.max_new_tokens / 4 if response_std is None else float(response_std)
    return Workload(
        prompts=algo.batch_size,
        samples_per_prompt=gen.samples_per_prompt,
        prompt_tokens=config.data.max_prompt_tokens if prompt_tokens is None else prompt_tokens,
        max_new_tokens=gen.max_new_tokens,
        response_mean=mean,
        response_std=std,
        train_steps=algo.updates_per_call,
        micro_batch_tokens=algo.micro_batch_tokens,
        share_prompts=algo.share_prompts,
        share_prompt_kv=gen.share_prompt_kv,
    )
