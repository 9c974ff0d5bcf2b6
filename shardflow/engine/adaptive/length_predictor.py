"""Remaining response lengths, learned from earlier iterations of the same run.

Before the first iteration all that is known is the length limit: a prior of ``prior_weight``
pseudo-samples spread uniformly over [1, max_len]. Each finished generation adds its response
lengths; the most recent ``max_samples`` are kept (whole iterations, oldest dropped first), so the
estimate sharpens as the run goes on and follows a drifting distribution.

With S(x) = P(L > x) the mixture of the empirical survival and the prior, a request that has
generated g tokens is still running t steps later with probability S(g + t) / S(g). A request
longer than every sample falls back on the prior alone (uniform over what the limit leaves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass(kw_only=True)
class LengthPredictor:
    max_len: int  # most tokens a response can have (max_new_tokens)
    max_samples: int = 8192  # lengths kept, most recent first
    prior_weight: float = 1.0  # pseudo-samples of the uniform prior over [1, max_len]
    _iterations: list[np.ndarray] = field(default_factory=list, repr=False)
    _sorted: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"max_len must be positive, got {self.max_len}")
        if self.max_samples < 1:
            raise ValueError(f"max_samples must be positive, got {self.max_samples}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be non-negative, got {self.prior_weight}")

    @property
    def num_samples(self) -> int:
        return len(self._sorted)

    def observe(self, lengths: Sequence[int]) -> None:
        """Add one generation's response lengths (clipped to [1, max_len])."""
        if len(lengths) == 0:
            return
        self._iterations.append(np.clip(np.asarray(lengths, dtype=np.float64), 1, self.max_len))
        while sum(len(a) for a in self._iterations) > self.max_samples and len(self._iterations) > 1:
            self._iterations.pop(0)
        kept = np.concatenate(self._iterations)[-self.max_samples:]
        self._sorted = np.sort(kept)

    def survival(self, x: np.ndarray) -> np.ndarray:
        """P(L > x), elementwise."""
        x = np.asarray(x, dtype=np.float64)
        prior = np.clip(1.0 - x / self.max_len, 0.0, 1.0)
        n = len(self._sorted)
        if n == 0:
            return prior
        empirical = (n - np.searchsorted(self._sorted, x, side="right")) / n
        return (n * empirical + self.prior_weight * prior) / (n + self.prior_weight)

    def still_running(self, generated: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        """[G, J]: P(L > g + t | L > g) for each generated count g [G] and steps ahead t [J]."""
        g = np.asarray(generated, dtype=np.float64)[:, None]
        t = np.asarray(ahead, dtype=np.float64)[None, :]
        now = self.survival(g)
        later = self.survival(g + t)
        prior_now = np.clip(1.0 - g / self.max_len, 0.0, 1.0)
        prior = np.divide(np.clip(1.0 - (g + t) / self.max_len, 0.0, 1.0), prior_now,
                          out=np.zeros(np.broadcast_shapes(g.shape, t.shape)), where=prior_now > 0)
        out = np.divide(later, now, out=prior.copy(), where=now > 1e-12)
        return np.clip(out, 0.0, 1.0)

    def expected_remaining(self, generated: np.ndarray) -> np.ndarray:
        """E[L - g | L > g] per generated count g (sum of the conditional survival)."""
        g = np.asarray(generated, dtype=np.float64)
        ahead = np.arange(self.max_len + 1, dtype=np.float64)
        return self.still_running(g, ahead).sum(axis=1)

    # ----- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"max_len": self.max_len, "iterations": [a.tolist() for a in self._iterations]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_len = int(state["max_len"])
        self._iterations, self._sorted = [], np.zeros(0)
        for lengths in state["iterations"]:
            self.observe(lengths)
