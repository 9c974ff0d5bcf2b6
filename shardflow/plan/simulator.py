"""Schedule the dataflow graph, unrolled over a few iterations, on devices.

It follows the runtime: every rank walks one global call order per iteration, so a device runs
its events in that order. Before a call, the model's parameters are reallocated into the call's
layout (on the source and destination devices together), then its input data is moved onto its
devices, then it runs. A call starts when:
- its devices are free (they finished every earlier event of the order that involved them),
- its inputs are ready (the calls producing them, in the same iteration, have finished),
- its model's parameters are at the right version: a call of a trained model waits for the
  previous iteration's train call of that model, and a train call waits for every earlier call of
  its model in the iteration (they read the parameters it is about to change).
Calls on disjoint devices overlap. Calls without devices (plain Python, e.g. a rule-based reward)
take no time and finish when their inputs are ready. Moving data occupies the consumer's devices
only: producers are assumed to hand their outputs over without waiting for the consumer's turn
(otherwise a producer busy with a later call would serialise calls on disjoint devices).

The steady iteration time is the mean gap between consecutive iteration ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, kw_only=True)
class SimCall:
    name: str
    devices: tuple[int, ...]  # ranks running the call; () for a call without a model
    seconds: float  # the call itself
    deps: tuple[str, ...] = ()  # calls of the same iteration whose outputs it reads
    model: str | None = None
    trains: bool = False  # updates its model's parameters
    data_seconds: float = 0.0  # moving its inputs onto its devices
    realloc_seconds: float = 0.0  # moving its model's parameters into its layout
    realloc_devices: tuple[int, ...] = ()  # ranks taking part in that (source and destination)


@dataclass(frozen=True)
class Event:
    iteration: int
    call: str
    phase: str  # "realloc" | "data" | "compute"
    devices: tuple[int, ...]
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    iteration_s: float  # steady-state time per iteration
    iteration_ends: tuple[float, ...]
    call_ends: dict[str, float]  # of the last iteration
    events: tuple[Event, ...] = ()


def _block(devices: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, last) when the ranks, in any order, are exactly a block of consecutive ranks."""
    lo, hi = min(devices), max(devices)
    return (lo, hi) if hi - lo + 1 == len(devices) and len(set(devices)) == len(devices) else None


def _index(devices: tuple[int, ...]):
    """A numpy index for the ranks: a slice when they form a block (the usual case)."""
    if not devices:
        return None
    block = _block(devices)
    return slice(block[0], block[1] + 1) if block else np.unique(devices)


def _union_index(a: tuple[int, ...], b: tuple[int, ...]):
    if not a or not b:
        return _index(a or b)
    ba, bb = _block(a), _block(b)
    if ba and bb and ba[0] <= bb[1] + 1 and bb[0] <= ba[1] + 1:
        return slice(min(ba[0], bb[0]), max(ba[1], bb[1]) + 1)  # overlapping or touching blocks
    return np.union1d(a, b)


def simulate(calls: Sequence[SimCall], num_devices: int, iterations: int = 3, *, events: bool = False) -> SimResult:
    """Schedule ``calls`` (in the global order) for ``iterations`` iterations."""
    if iterations < 1:
        raise ValueError(f"simulate at least one iteration, got {iterations}")
    names = [c.name for c in calls]
    position = {n: i for i, n in enumerate(names)}
    for c in calls:
        for d in c.deps:
            if d not in position:
                raise ValueError(f"call {c.name!r} depends on {d!r}, which is not in the graph")
            if position[d] >= position[c.name]:
                raise ValueError(f"call {c.name!r} depends on {d!r}, which comes later in the global order")
        if c.devices and (min(c.devices) < 0 or max(c.devices) >= num_devices):
            raise ValueError(f"call {c.name!r} uses devices outside 0..{num_devices - 1}")
    idx = {c.name: _index(c.devices) for c in calls}
    realloc_idx = {c.name: _union_index(c.realloc_devices, c.devices) for c in calls}
    train_of = {c.model: c.name for c in calls if c.trains}

    free = np.zeros(num_devices)
    trained_at: dict[str, float] = {}  # model -> when its last train call finished
    log: list[Event] = []
    ends: list[float] = []
    end: dict[str, float] = {}
    for it in range(iterations):
        end = {}
        for c in calls:
            inputs = max((end[d] for d in c.deps), default=0.0)
            if c.trains:  # earlier readers of the parameters must be done
                version = max([trained_at.get(c.model, 0.0)]
                              + [end[o.name] for o in calls[:position[c.name]] if o.model == c.model])
            else:
                version = trained_at.get(c.model, 0.0) if c.model in train_of else 0.0
            if not c.devices:
                end[c.name] = max(inputs, version)
                continue
            i = idx[c.name]
            if c.realloc_seconds > 0:
                ri = realloc_idx[c.name]
                t0 = max(float(free[ri].max()), version)
                free[ri] = t0 + c.realloc_seconds
                if events:
                    log.append(Event(it, c.name, "realloc", _ranks(ri), t0, t0 + c.realloc_seconds))
            start = max(float(free[i].max()), inputs, version)
            if events and c.data_seconds > 0:
                log.append(Event(it, c.name, "data", c.devices, start, start + c.data_seconds))
            begin = start + c.data_seconds
            finish = begin + c.seconds
            if events:
                log.append(Event(it, c.name, "compute", c.devices, begin, finish))
            free[i] = finish
            end[c.name] = finish
            if c.trains:
                trained_at[c.model] = finish
        ends.append(max(end.values(), default=0.0))
    steady = (ends[-1] - ends[0]) / (iterations - 1) if iterations > 1 else ends[0]
    return SimResult(steady, tuple(ends), end, tuple(log))


def _ranks(index) -> tuple[int, ...]:
    if isinstance(index, slice):
        return tuple(range(index.start, index.stop))
    return tuple(int(r) for r in index)
