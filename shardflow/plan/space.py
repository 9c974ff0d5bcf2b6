"""The space of plans: device sets, layouts over them, micro-batch counts.

Following ReaL, a call's devices are an aligned block inside one node (1, 2, 4, ... GPUs) or whole
consecutive nodes. A layout over them keeps tp inside a node, runs generation with pp = 1, gives
every DP replica at least one sequence, and must fit the model alone (a plan may still fail when
models share devices; the estimate checks that).
"""

from __future__ import annotations

import math
import random
from functools import cached_property, lru_cache

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import check_layout
from shardflow.perf.hardware import GB, Cluster
from shardflow.plan import memory as mem
from shardflow.plan.memory import AnyLayout, Shape
from shardflow.plan.problem import Choice, Problem
from shardflow.rl.graph import Call, Kind

DeviceSet = tuple[int, int]  # (first rank, size)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def device_sets(cluster: Cluster) -> tuple[DeviceSet, ...]:
    g = cluster.gpus_per_node
    sets: list[DeviceSet] = []
    for node in range(cluster.num_nodes):
        size = 1
        while size <= g:
            sets.extend((start, size) for start in range(node * g, (node + 1) * g, size))
            size *= 2
    for count in range(2, cluster.num_nodes + 1):
        sets.extend((first * g, count * g) for first in range(cluster.num_nodes - count + 1))
    return tuple(sets)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=4096)
def splits(cfg: ModelConfig, pp: int, tp: int) -> bool:
    """Whether the model can be split pp x tp (the ranks do not matter)."""
    if pp > cfg.num_layers:
        return False
    try:
        check_layout(cfg, Layout.contiguous(pp=pp, tp=tp))
    except ValueError:
        return False
    return True


class Space:
    def __init__(self, problem: Problem, *, micro_batches: tuple[int, ...] = MICRO_BATCHES):
        self.problem = problem
        self.micro_batches = tuple(sorted(set(micro_batches)))
        if not self.micro_batches or self.micro_batches[0] < 1:
            raise ValueError(f"micro-batch choices must be positive integers, got {micro_batches}")
        self.sets = device_sets(problem.cluster)
        self._shapes: dict[tuple[str, int], tuple[Shape, ...]] = {}
        self._sizes: dict[str, tuple[int, ...]] = {}
        self._layouts: dict[tuple[int, int, int, int], Layout] = {}
        for call in problem.calls:
            if not any(self.shapes(call, size) for size in self.sizes):
                raise ValueError(self._no_fit_message(call))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted({size for _, size in self.sets}))

    @cached_property
    def starts(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for start, size in self.sets:
            out.setdefault(size, []).append(start)
        return {size: tuple(v) for size, v in out.items()}

    # ----- layouts ---------------------------------------------------------------------------

    def _alone_bytes(self, call: Call, layout: Shape) -> float:
        """Memory the call needs on a device with nothing else there (its fewest micro-batches'
        worth of activations, one KV-cache slot)."""
        p, problem = self.problem.precision, self.problem
        cfg = problem.models[call.model]
        if call.kind is Kind.TRAIN:
            k = self.micro_options(call, layout)[-1]
            tokens = problem.tokens_per_micro_batch(call, layout, k)
            return (problem.trained_state_bytes(call.model, layout)
                    + mem.train_activation_bytes(cfg, layout, tokens, k, problem.checkpointing.get(call.model, False), p))
        if call.kind is Kind.GENERATE:
            return (mem.weight_bytes(cfg, layout, p) + mem.decode_copy_bytes(cfg, layout.tp, p, problem.transposed_weights)
                    + mem.kv_bytes_per_slot(cfg, layout.tp, problem.workload.max_tokens, p))
        k = self.micro_options(call, layout)[-1]
        tokens = problem.tokens_per_micro_batch(call, layout, k)
        return mem.weight_bytes(cfg, layout, p) + mem.inference_activation_bytes(cfg, layout, tokens, p)

    def shapes(self, call: Call, size: int) -> tuple[Shape, ...]:
        """(pp, dp, tp) over ``size`` devices that this call can use."""
        key = (call.name, size)
        if key not in self._shapes:
            problem = self.problem
            cfg = problem.models[call.model]
            max_dp = math.ceil(problem.workload.sequences / problem.steps(call))
            found = []
            for tp in _divisors(min(size, problem.cluster.gpus_per_node)):
                if size % tp:
                    continue
                for pp in ([1] if call.kind is Kind.GENERATE else _divisors(size // tp)):
                    shape = Shape(pp, size // (tp * pp), tp)
                    if shape.dp <= max_dp and splits(cfg, pp, tp) \
                            and self._alone_bytes(call, shape) <= problem.cluster.usable_memory:
                        found.append(shape)
            self._shapes[key] = tuple(found)
        return self._shapes[key]

    def usable_sizes(self, call: Call) -> tuple[int, ...]:
        """Device-set sizes on which the call has a layout."""
        if call.name not in self._sizes:
            self._sizes[call.name] = tuple(s for s in self.sizes if self.shapes(call, s))
        return self._sizes[call.name]

    def layout(self, start: int, pp: int, dp: int, tp: int) -> Layout:
        key = (start, pp, dp, tp)
        if key not in self._layouts:
            self._layouts[key] = Layout.contiguous(start, pp=pp, dp=dp, tp=tp)
        return self._layouts[key]

    def micro_options(self, call: Call, layout: AnyLayout) -> tuple[int | None, ...]:
        if call.kind is Kind.GENERATE:
            return (None,)
        most = self.problem.replica_sequences(call, layout)
        return tuple(k for k in self.micro_batches if k <= most) or (1,)

    def choices_on(self, call: Call, start: int, size: int) -> list[Choice]:
        return [Choice(self.layout(start, *shape), k) for shape in self.shapes(call, size)
                for k in self.micro_options(call, self.layout(start, *shape))]

    def choices(self, call: Call) -> list[Choice]:
        return [c for start, size in self.sets for c in self.choices_on(call, start, size)]

    def count(self) -> int:
        """Plans in the space (product over calls)."""
        total = 1
        for call in self.problem.calls:
            total *= sum(len(self.starts[size]) * len(self.micro_options(call, shape))
                         for size in self.sizes for shape in self.shapes(call, size))
        return total

    # ----- random moves ----------------------------------------------------------------------

    def random_set(self, call: Call, rng: random.Random) -> DeviceSet:
        """A size uniformly among those the call can use, then a position uniformly."""
        size = rng.choice(self.usable_sizes(call))
        return rng.choice(self.starts[size]), size

    def nearby_set(self, call: Call, start: int, size: int, rng: random.Random) -> DeviceSet:
        """A device set next to this one: twice or half as large, one node more or fewer, or
        shifted by its size or by a node (local steps matter when there are thousands of sets)."""
        g = self.problem.cluster.gpus_per_node
        options = {(start, size * 2), (start, size // 2), (start + size - size // 2, size // 2),
                   (start - size, size), (start + size, size)}
        if size >= g:
            options |= {(start, size + g), (start, size - g), (start + g, size - g), (start - g, size + g),
                        (start - g, size), (start + g, size)}
        valid = sorted(o for o in options if o in self._set_index and o[1] in self.usable_sizes(call))
        return rng.choice(valid) if valid else self.random_set(call, rng)

    @cached_property
    def _set_index(self) -> frozenset:
        return frozenset(self.sets)

    def random_on(self, call: Call, start: int, size: int, rng: random.Random,
                  keep: Choice | None = None) -> Choice | None:
        """A choice on these devices: the kept one's tp and pp when they fit, else a random shape;
        the kept micro-batch count when valid, else a random one."""
        shapes = self.shapes(call, size)
        if not shapes:
            return None
        shape = None
        if keep is not None:
            same = [s for s in shapes if s[0] == keep.layout.pp and s[2] == keep.layout.tp]
            shape = same[0] if same else None
        shape = shape or rng.choice(shapes)
        layout = self.layout(start, *shape)
        options = self.micro_options(call, layout)
        k = keep.micro_batches if keep is not None and keep.micro_batches in options else rng.choice(options)
        return Choice(layout, k)

    def random_choice(self, call: Call, rng: random.Random) -> Choice:
        start, size = self.random_set(call, rng)
        return self.random_on(call, start, size, rng)

    # ----- errors ----------------------------------------------------------------------------

    def _no_fit_message(self, call: Call) -> str:
        problem = self.problem
        cfg = problem.models[call.model]
        n = problem.cluster.num_devices
        best = None
        for tp in _divisors(min(n, problem.cluster.gpus_per_node)):
            for pp in ([1] if call.kind is Kind.GENERATE else _divisors(n // tp)):
                shape = Shape(pp, n // (tp * pp), tp)
                if not splits(cfg, pp, tp):
                    continue
                need = self._alone_bytes(call, shape)
                if best is None or need < best[0]:
                    best = (need, shape)
        detail = (f"even d{best[1].dp}p{best[1].pp}t{best[1].tp} on all {n} devices needs {best[0] / GB:.1f} GB per GPU"
                  if best else f"no layout of it over {n} devices is valid")
        return (f"call {call.name!r}: model {call.model!r} ({cfg.num_params() / 1e9:.2f}B parameters) does not fit "
                f"on any device set of this cluster: {detail}, and {problem.cluster.usable_memory / GB:.1f} GB "
                "are usable")
