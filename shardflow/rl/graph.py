"""The dataflow graph of an RL iteration: model function calls and the data keys between them.

A call runs one model (by role: actor, critic, ref, reward) in one way (generate, inference,
train), reads some keys of the iteration's batch and writes others. A ``function`` call runs
plain Python on the batch (a rule-based reward) and holds no model. The runtime executes calls in
one global topological order; the planner places each model call on its own devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN = "train"
    FUNCTION = "function"  # no model: plain Python over the batch, placed with its inputs


@dataclass(frozen=True)
class Call:
    name: str
    kind: Kind
    model: str | None  # model role; None for FUNCTION calls
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    greedy: bool = False  # a generate call that decodes greedily (ReMax's baseline), whatever the sampling settings

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if (self.model is None) != (self.kind is Kind.FUNCTION):
            raise ValueError(f"call {self.name!r}: exactly the function calls hold no model")


@dataclass(frozen=True)
class Graph:
    """Calls in declaration order; ``sources`` are the keys the dataset provides."""

    name: str
    calls: tuple[Call, ...]
    sources: tuple[str, ...] = ("prompts",)

    def __post_init__(self) -> None:
        names = [c.name for c in self.calls]
        if len(set(names)) != len(names):
            raise ValueError(f"graph {self.name!r} repeats a call name: {names}")
        producer: dict[str, str] = {k: "<data>" for k in self.sources}
        for c in self.calls:
            for key in c.outputs:
                if key in producer:
                    raise ValueError(f"key {key!r} is written by both {producer[key]!r} and {c.name!r}")
                producer[key] = c.name
        for c in self.calls:
            for key in c.inputs:
                if key not in producer:
                    raise ValueError(f"call {c.name!r} reads {key!r}, which no call or data source provides")
        object.__setattr__(self, "_producer", producer)
        object.__setattr__(self, "_order", self._topological_order())

    def _topological_order(self) -> tuple[Call, ...]:
        deps = {c.name: set(self.dependencies(c)) for c in self.calls}
        done: list[Call] = []
        remaining = list(self.calls)
        while remaining:
            ready = [c for c in remaining if deps[c.name] <= {d.name for d in done}]
            if not ready:
                cycle = ", ".join(c.name for c in remaining)
                raise ValueError(f"graph {self.name!r} has a cycle among calls: {cycle}")
            done.append(ready[0])  # declaration order among the ready ones: stable and predictable
            remaining.remove(ready[0])
        return tuple(done)

    # ----- queries ---------------------------------------------------------------------------

    @property
    def order(self) -> tuple[Call, ...]:
        """The one global order every rank walks."""
        return self._order

    def call(self, name: str) -> Call:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(f"graph {self.name!r} has no call {name!r}; calls: {[c.name for c in self.calls]}")

    def producer(self, key: str) -> str:
        """Name of the call writing ``key``, or ``"<data>"`` for a data source."""
        return self._producer[key]

    def dependencies(self, call: Call) -> list[str]:
        """Names of the calls whose outputs ``call`` reads, in declaration order."""
        names = {self._producer[k] for k in call.inputs} - {"<data>"}
        return [c.name for c in self.calls if c.name in names]

    def model_calls(self) -> tuple[Call, ...]:
        return tuple(c for c in self.calls if c.kind is not Kind.FUNCTION)

    def models(self) -> tuple[str, ...]:
        """Model roles in order of first use."""
        seen: list[str] = []
        for c in self.calls:
            if c.model is not None and c.model not in seen:
                seen.append(c.model)
        return tuple(seen)

    def trained_models(self) -> tuple[str, ...]:
        return tuple(m for m in self.models() if any(c.model == m and c.kind is Kind.TRAIN for c in self.calls))

    def train_call(self, model: str) -> Call | None:
        return next((c for c in self.calls if c.model == model and c.kind is Kind.TRAIN), None)

    def home_call(self, model: str) -> Call:
        """Where a model's parameters live between calls: its train call (the optimizer state is
        there), else its first call."""
        return self.train_call(model) or next(c for c in self.calls if c.model == model)
