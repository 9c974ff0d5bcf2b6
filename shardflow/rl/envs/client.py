"""The rank's side of a generate call's episodes: each episode's environment lives in a worker
(``rl.envs.hosting``); a finished turn is sent there as text, and the observation that comes
back becomes the next turn's tokens (``rl.envs.chat``). The engine side of the loop is
``engine.generate.episodes``; a request here is its ``Request`` (read, never changed).

An episode ends when its environment says done, after ``max_turns`` turns, when the observation
would not fit in the episode's or the context's token limit, or when its environment raises or
times out (it then gets ``error_value``, counted, with the first error kept).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from shardflow.rl.envs import EnvSpec
from shardflow.rl.envs.chat import ObservationFormat
from shardflow.rl.workers import WorkerPool

CHANNEL = "episodes"
HOSTING = "shardflow.rl.envs.hosting"
_CLIENTS = itertools.count()  # episode keys stay unique across calls in one process


@dataclass
class Episode:
    home: int
    rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    seconds: float = 0.0  # in the environment
    error: str = ""  # why the environment failed, if it did
    truncated: bool = False  # the next observation did not fit


@dataclass(kw_only=True)
class EpisodeLimits:
    max_turns: int
    max_output: int  # tokens after the prompt, observations included
    max_seq_len: int  # the engine's context limit
    timeout_s: float
    episode_reward: str = "sum"  # or "last"
    error_value: float = 0.0


class EpisodeClient:
    def __init__(self, pool: WorkerPool, spec: EnvSpec, observations: ObservationFormat, tokenizer,
                 limits: EpisodeLimits):
        self.pool, self.spec, self.format, self.tokenizer, self.limits = pool, spec, observations, tokenizer, limits
        self.serial = next(_CLIENTS)
        self.episodes: dict[int, Episode] = {}
        self._requests: dict[int, Any] = {}
        self.waited = 0.0  # seconds the rank waited for an environment with nothing to decode

    # ----- the engine loop's side (``engine.generate.episodes.Turns``) -------------------------

    def begin(self, request: Any, row: dict) -> None:
        home, _ = self.pool.home_for()
        self.episodes[request.request_id] = Episode(home)
        self._requests[request.request_id] = request
        self.pool.call(CHANNEL, ("open", self.serial, request.request_id), f"{HOSTING}:open_episode",
                       self._key(request.request_id), self.spec, row, timeout_s=self.limits.timeout_s, home=home)

    def ended(self, request: Any) -> None:
        """A turn ended: its text goes to the episode's environment."""
        text = self.tokenizer.decode(request.output_ids[request.turn_start:], skip_special_tokens=True)
        self.pool.call(CHANNEL, ("step", self.serial, request.request_id), f"{HOSTING}:step_episode",
                       self._key(request.request_id), text, timeout_s=self.limits.timeout_s,
                       home=self.episodes[request.request_id].home)

    def ready(self, wait: bool) -> list[tuple[int, list[int] | None]]:
        """Episodes whose environment answered: (request id, the next observation's tokens, or
        None when the episode is over). With ``wait``: at least one."""
        out: list[tuple[int, list[int] | None]] = []
        start = time.perf_counter()
        while True:
            for result in self.pool.results(CHANNEL, wait=wait and not out, timeout=1.0):
                kind, serial, request_id = result.key
                if serial != self.serial or kind == "close":
                    continue
                episode = self.episodes[request_id]
                if kind == "open":
                    episode.error = episode.error or ("" if result.ok else str(result.value))
                    continue
                episode.seconds += result.seconds
                out.append((request_id, self._next(request_id, episode, result)))
            if out or not wait:
                break
        if wait:
            self.waited += time.perf_counter() - start
        return out

    def _next(self, request_id: int, episode: Episode, result) -> list[int] | None:
        request = self._requests[request_id]
        if episode.error or not result.ok:
            episode.error = episode.error or str(result.value)
            return self._close(request_id, episode)
        step = result.value
        episode.rewards.append(step.reward)
        episode.tool_calls += int(step.info.get("tool_calls", 0))
        episode.tool_errors += int(step.info.get("tool_errors", 0))
        if step.done or request.turns >= self.limits.max_turns:
            return self._close(request_id, episode)
        last = request.output_ids[-1]
        stop_text = self.tokenizer.decode([last]) if request.finish_reason == "stop" else None
        ids = self.format.ids(step.observation, stop_text)
        after = len(request.output_ids) + len(ids)
        if not ids or after >= self.limits.max_output or request.num_tokens + len(ids) + 1 >= self.limits.max_seq_len:
            episode.truncated = True
            return self._close(request_id, episode)
        episode.observation_tokens += len(ids)
        return ids

    def _close(self, request_id: int, episode: Episode) -> None:
        self.pool.call(CHANNEL, ("close", self.serial, request_id), f"{HOSTING}:close_episode",
                       self._key(request_id), timeout_s=self.limits.timeout_s, home=episode.home)
        self.pool.leave(episode.home)
        return None

    def _key(self, request_id: int) -> tuple[int, int]:
        return self.serial, request_id

    # ----- what the episodes came to -----------------------------------------------------------

    def reward(self, request_id: int) -> float:
        """The environment's reward of an episode (``error_value`` if its environment failed)."""
        episode = self.episodes[request_id]
        if episode.error:
            return self.limits.error_value
        if not episode.rewards:
            return 0.0
        return episode.rewards[-1] if self.limits.episode_reward == "last" else sum(episode.rewards)

    def errors(self) -> tuple[int, str]:
        failed = [e.error for e in self.episodes.values() if e.error]
        return len(failed), failed[0] if failed else ""
