"""The ``http`` reward: the texts posted as JSON to a server of the user's, which answers with
the rewards. It runs in the worker pool, so a slow or failing server costs a timeout, not a hang."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

from shardflow.rl.rewards.texts import RewardFn


def http_reward(url: str, timeout_s: float = 30.0) -> RewardFn:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward.url must be an http:// or https:// address, got {url!r}")

    def reward(prompts: list[str], responses: list[str], answers: list[Any]) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses, "answers": answers}, default=str).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                reply = json.loads(answer.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the reward server {url} answered {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise RuntimeError(f"the reward server {url} cannot be reached: {e}") from None
        values = reply.get("rewards") if isinstance(reply, dict) else reply
        if not isinstance(values, list) or len(values) != len(responses):
            raise ValueError(f"the reward server {url} must answer {{\"rewards\": [...]}} with {len(responses)} "
                             f"numbers, got {reply!r:.200}")
        out = [float(v) for v in values]
        if not all(math.isfinite(v) for v in out):
            raise ValueError(f"the reward server {url} answered a non-finite reward")
        return out

    return reward
