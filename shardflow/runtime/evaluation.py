"""Held-out evaluation: the eval prompts through the run's generate call and the calls that score
its responses, once greedily and once with ``eval.samples`` samples per prompt.

Metrics (under ``eval/``): ``pass@1`` (the share of prompts whose greedy response is correct, its
reward at least ``eval.correct_reward``), ``greedy_reward`` (the greedy responses' mean reward),
``mean@k`` (the sampled responses' mean reward), ``pass@k`` (the share of prompts with a correct
sample among k), ``response_length``, ``reward_errors`` and ``seconds``. Each evaluation's responses
go to ``out_dir/eval/iter-N.jsonl``, a line per prompt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from shardflow.config.experiment import ExperimentConfig
from shardflow.data.prompts import Prompt
from shardflow.parallel.world import World
from shardflow.runtime.calls.context import CallReport, Sampling
from shardflow.runtime.calls.data import Held


@dataclass(frozen=True)
class Scored:
    """One evaluated response."""

    sample: int  # sample id: prompt position in the eval set x samples + j
    reward: float
    length: int  # response tokens (observations of an episode included)
    text: str
    finish_reason: str


def eval_passes(config: ExperimentConfig) -> list[tuple[str, Sampling]]:
    """The passes an evaluation runs: greedy, then sampled (when ``eval.samples`` > 0)."""
    ev, gen = config.eval, config.generation
    max_new = ev.max_new_tokens or gen.max_new_tokens
    passes = [("greedy", Sampling(samples_per_prompt=1, temperature=0.0, max_new_tokens=max_new))]
    if ev.samples:
        temperature = ev.temperature if ev.temperature is not None else gen.temperature
        passes.append(("sampled", Sampling(samples_per_prompt=ev.samples, temperature=temperature,
                                           max_new_tokens=max_new)))
    return passes


def eval_metrics(greedy: list[Scored], sampled: list[Scored], *, num_prompts: int, samples: int,
                 correct_reward: float) -> dict[str, float]:
    """The evaluation's metrics from its scored responses (see the module's docstring)."""
    out = {"eval/prompts": float(num_prompts)}
    if greedy:
        out["eval/pass@1"] = sum(s.reward >= correct_reward for s in greedy) / len(greedy)
        out["eval/greedy_reward"] = sum(s.reward for s in greedy) / len(greedy)
        out["eval/response_length"] = sum(s.length for s in greedy) / len(greedy)
    if sampled:
        out[f"eval/mean@{samples}"] = sum(s.reward for s in sampled) / len(sampled)
        solved = {s.sample // samples for s in sampled if s.reward >= correct_reward}
        out[f"eval/pass@{samples}"] = len(solved) / num_prompts
    return out


def evaluate(world: World, config: ExperimentConfig, prompts: list[Prompt], tokenizer,
             walk: Callable[[Sampling], tuple[dict[str, Held], dict[str, CallReport]]],
             samples_file: Path | None) -> dict[str, float]:
    """Run every pass through ``walk`` (the generate and reward calls on ``prompts`` with that
    sampling: what they hold on this rank, and their reports), gather the scored responses on every
    rank and return the metrics; rank 0 writes ``samples_file``. Collective over the world."""
    start = time.time()
    scored: dict[str, list[Scored]] = {}
    errors = 0.0
    for name, sampling in eval_passes(config):
        held, reports = walk(sampling)
        mine = (_local_rewards(held), _local_responses(held, tokenizer),
                sum(r.metrics.get("reward/errors", 0.0) for r in reports.values()))
        gathered: list = [None] * world.size
        dist.all_gather_object(gathered, mine)
        rewards = {k: v for part in gathered for k, v in part[0].items()}
        responses = {k: v for part in gathered for k, v in part[1].items()}
        errors += sum(part[2] for part in gathered)
        scored[name] = [Scored(sample, rewards[sample], *responses[sample]) for sample in sorted(rewards)]
    samples = config.eval.samples
    metrics = eval_metrics(scored["greedy"], scored.get("sampled", []), num_prompts=len(prompts), samples=samples,
                           correct_reward=config.eval.correct_reward)
    metrics["eval/reward_errors"] = errors
    metrics["eval/seconds"] = time.time() - start
    if world.rank == 0 and samples_file is not None:
        write_samples(samples_file, prompts, scored["greedy"], scored.get("sampled", []), samples)
    return metrics


def _local_rewards(held: dict[str, Held]) -> dict[int, float]:
    batch = held["rewards"].batch
    if batch is None:
        return {}
    return dict(zip(batch.sample_ids.tolist(), batch.seq_fields["rewards"].tolist()))


def _local_responses(held: dict[str, Held], tokenizer) -> dict[int, tuple[int, str, str]]:
    """sample id -> (response length, text, finish reason) of the responses held on this rank."""
    batch = held["responses"].batch
    if batch is None:
        return {}
    out = {}
    reasons = batch.meta.get("finish_reason", [""] * len(batch))
    offsets, ids = batch.offsets.tolist(), batch.token_fields["input_ids"]
    for i, sample in enumerate(batch.sample_ids.tolist()):
        response = ids[offsets[i] + int(batch.seq_fields["prompt_lengths"][i]):offsets[i + 1]].tolist()
        out[sample] = (len(response), tokenizer.decode(response, skip_special_tokens=True), str(reasons[i]))
    return out


def write_samples(path: Path, prompts: list[Prompt], greedy: list[Scored], sampled: list[Scored],
                  samples: int) -> None:
    """A line per prompt: the prompt, its answer, the greedy response and reward, the sampled rewards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    by_prompt: dict[int, list[float]] = {}
    for s in sampled:
        by_prompt.setdefault(s.sample // samples, []).append(s.reward)
    with path.open("w", encoding="utf-8") as f:
        for s in greedy:
            p = prompts[s.sample]
            f.write(json.dumps({"index": p.index, "prompt": p.text, "answer": p.answer, "response": s.text,
                                "reward": s.reward, "finish_reason": s.finish_reason,
                                "sampled_rewards": by_prompt.get(s.sample, [])}, default=str) + "\n")
