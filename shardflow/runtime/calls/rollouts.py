"""A generate call's work beside decoding, on the holder of each replica: rewards scored in the
worker pool as responses finish, and the environments of multi-turn episodes.

``CallRollouts`` is made per generate call on the holder (tp index 0 of a replica). Its
``finished`` hook sends each finished response (an episode's last turn) to be scored; ``attach``
waits for what is left, adds the seq fields ``response_rewards`` (the reward functions' weighted
total) and ``env_rewards`` (an episode's environment reward) to the rollouts, and reports the
rollout metrics. The reward call then adds them up (``runtime.calls.function``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardflow.config.experiment import ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.data.prompts import Prompt
from shardflow.engine.generate.episodes import Answers
from shardflow.engine.generate.requests import Request
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.rl.envs import EnvSpec
from shardflow.rl.envs.chat import ObservationFormat
from shardflow.rl.envs.client import EpisodeClient, EpisodeLimits
from shardflow.rl.rewards import reward_kind
from shardflow.rl.rewards.pooled import PooledRewards, warm_up
from shardflow.rl.workers import WorkerPool
from shardflow.runtime.calls.context import CallReport


def env_spec(config: ExperimentConfig) -> EnvSpec:
    r = config.rollout
    return EnvSpec(env=r.env, tools=tuple(r.tools), tool_format=r.tool_format, role=r.observation_role)


def episode_output_limit(config: ExperimentConfig) -> int:
    """The tokens after the prompt an episode (or a one-turn response) may take."""
    return config.rollout.max_tokens_per_episode if config.rollout.env else config.generation.max_new_tokens


def pooled_scoring(config: ExperimentConfig) -> bool:
    """Whether rewards are scored in the worker pool during generation (else by the reward call)."""
    return config.rollout.workers > 0 and reward_kind(config.reward.kind).model is None


def uses_workers(config: ExperimentConfig) -> bool:
    """Whether a replica's holder runs work beside decoding in the worker pool."""
    return bool(config.rollout.env) or pooled_scoring(config)


def start_workers(config: ExperimentConfig, pool: WorkerPool) -> None:
    """Start the pool before the first generate call, beside the run's own start (loading models);
    with pooled scoring each worker builds the reward's terms then too."""
    if pooled_scoring(config):
        warm_up(pool, config.reward)
    else:
        pool.start()


class CallRollouts:
    def __init__(self, config: ExperimentConfig, pool: WorkerPool | None, tokenizer, prompts: list[Prompt],
                 max_seq_len: int):
        self.config, self.tokenizer, self.prompts = config, tokenizer, prompts
        self.rewards = PooledRewards(pool, config.reward) if pooled_scoring(config) else None
        self.client = None
        if config.rollout.env:
            r = config.rollout
            limits = EpisodeLimits(max_turns=r.max_turns, max_output=r.max_tokens_per_episode, max_seq_len=max_seq_len,
                                   timeout_s=r.step_timeout_s, episode_reward=r.episode_reward,
                                   error_value=config.reward.error_value)
            observations = ObservationFormat(tokenizer, r.observation_role, chat=config.data.chat_template)
            self.client = EpisodeClient(pool, env_spec(config), observations, tokenizer, limits)

    def finished(self, r: Request) -> None:
        """A response (or an episode) is over: score its last turn."""
        if self.rewards is None:
            return
        prompt = self.prompts[r.group]
        text = self.tokenizer.decode(r.output_ids[r.turn_start:], skip_special_tokens=True)
        self.rewards.submit(r.request_id, prompt.text, text, prompt.answer)

    def attach(self, batch: SequenceBatch, mine: list[Request], report: CallReport) -> SequenceBatch:
        """``batch`` (the rollouts of ``mine``, in order) with the rewards and episode facts."""
        fields: dict[str, torch.Tensor] = {}
        if self.rewards is not None:
            scores = self.rewards.collect()
            fields["response_rewards"] = torch.tensor([scores.rewards[r.request_id] for r in mine])
            if self.config.reward.kind == "weighted":  # each term's mean is a metric
                for name, values in scores.terms.items():
                    report.rollout[f"reward_term/{name}"] = values
            report.metrics["time/rollout/rewards"] = scores.seconds
            report.metrics["time/rollout/waited"] = scores.waited
            if scores.errors:
                report.metrics["reward/errors"] = float(scores.errors)
                report.errors.append(f"the reward raised or timed out for {scores.errors} of {len(mine)} responses "
                                     f"(given reward.error_value={self.config.reward.error_value}): "
                                     f"{scores.first_error}")
        if self.client is not None:
            client = self.client
            fields["env_rewards"] = torch.tensor([client.reward(r.request_id) for r in mine])
            episodes = [client.episodes[r.request_id] for r in mine]
            report.rollout["turns"] = [r.turns for r in mine]
            report.rollout["tool_calls"] = [e.tool_calls for e in episodes]
            report.rollout["tool_errors"] = [e.tool_errors for e in episodes]
            report.rollout["observation_tokens"] = [e.observation_tokens for e in episodes]
            report.metrics["time/rollout/environments"] = sum(e.seconds for e in episodes)
            report.metrics["time/rollout/waited"] = report.metrics.get("time/rollout/waited", 0.0) + client.waited
            report.metrics["rollout/truncated"] = float(sum(e.truncated for e in episodes))
            failed, first = client.errors()
            if failed:
                report.metrics["rollout/env_errors"] = float(failed)
                report.errors.append(f"the environment raised or timed out in {failed} of {len(mine)} episodes "
                                     f"(given reward.error_value={self.config.reward.error_value}): {first}")
        return batch.update(seq_fields=fields) if fields else batch


def replica_share_fn(world: World, layout: Layout) -> Callable[[Answers | None], Answers]:
    """Broadcast the replica holder's answers to its tp ranks (identity without tp)."""
    group = world.groups.get(layout.tp_group(world.rank))
    if group is None:
        return lambda answers: answers
    c = layout.coord(world.rank)
    holder = layout.rank_at(c.pp, c.dp, 0)

    def share(answers: Answers | None) -> Answers:
        box = [answers]
        dist.broadcast_object_list(box, src=holder, group=group)
        return box[0]

    return share
