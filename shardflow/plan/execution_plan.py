"""Execution plans: for every model call, its devices and (pp, dp, tp) layout.

Plans are data. A hand-written plan file and one written by the planner go through the same
validation and the same runtime (the format is ``PLAN_FILE_FORMAT``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from shardflow.config.files import read_yaml
from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout, split_replicas
from shardflow.parallel.sharding import check_layout
from shardflow.rl.graph import Graph, Kind

PLAN_FILE_FORMAT = """A plan file (plan: FILE.yaml) gives every model call of the algorithm's graph its layout:

    calls:
      actor_gen:   {layout: d4p1t1@0-3, tp_targets: [d2p1t2@0-3, d1p1t4@0-3]}
      ref_inf:     {layout: d2p1t1@4-5}
      actor_train: {layout: d1p2t2@0-3, micro_batches: 4}

A layout is d{dp}p{pp}t{tp}@{ranks} (tp innermost); a bare layout string stands for {layout: ...}.
micro_batches (optional) fixes the micro-batches per data-parallel replica of an inference or
training call; otherwise algorithm.micro_batch_tokens decides (unset: the device's free memory).
tp_targets (generate calls only) are the layouts adaptive tensor parallelism may switch to, each
merging replicas of the one before.
shardflow plan writes such a file; plan: symmetric puts every call on every device."""


@dataclass(frozen=True, kw_only=True)
class CallPlan:
    layout: Layout
    micro_batches: int | None = None
    tp_targets: tuple[Layout, ...] = ()
    estimated_s: float | None = None  # the planner's estimate, for reports only

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": str(self.layout)}
        if self.micro_batches is not None:
            out["micro_batches"] = self.micro_batches
        if self.tp_targets:
            out["tp_targets"] = [str(t) for t in self.tp_targets]
        if self.estimated_s is not None:
            out["estimated_s"] = round(self.estimated_s, 6)
        return out

    @classmethod
    def from_dict(cls, call: str, raw: Any) -> "CallPlan":
        if isinstance(raw, str):
            raw = {"layout": raw}
        if not isinstance(raw, dict) or "layout" not in raw:
            raise ValueError(f"plan entry for {call!r} must be a mapping with a 'layout', got {raw!r}")
        unknown = set(raw) - {"layout", "micro_batches", "tp_targets", "estimated_s"}
        if unknown:
            raise ValueError(f"plan entry for {call!r} has unknown keys {sorted(unknown)}")
        try:
            layout = Layout.parse(str(raw["layout"]))
            targets = tuple(Layout.parse(str(t)) for t in raw.get("tp_targets") or ())
        except ValueError as e:
            raise ValueError(f"plan entry for {call!r}: {e}") from None
        mb = raw.get("micro_batches")
        if mb is not None and (not isinstance(mb, int) or mb < 1):
            raise ValueError(f"plan entry for {call!r}: micro_batches must be a positive integer, got {mb!r}")
        return cls(layout=layout, micro_batches=mb, tp_targets=targets, estimated_s=raw.get("estimated_s"))


@dataclass(frozen=True)
class ExecutionPlan:
    calls: Mapping[str, CallPlan]
    notes: Mapping[str, Any] = field(default_factory=dict)  # free-form (planner estimates, baselines)

    def __getitem__(self, call: str) -> CallPlan:
        return self.calls[call]

    def layouts(self) -> list[Layout]:
        found = {p.layout for p in self.calls.values()}
        found.update(t for p in self.calls.values() for t in p.tp_targets)
        return sorted(found, key=str)

    def num_devices(self) -> int:
        return 1 + max(r for p in self.calls.values() for r in p.layout.ranks)

    # ----- validation -------------------------------------------------------------------------

    def validate(self, graph: Graph, models: Mapping[str, ModelConfig], num_devices: int) -> None:
        """Raise ValueError naming the first problem: a call not covered, an unknown call,
        devices that do not exist, a layout the model cannot be split into, bad targets."""
        model_calls = {c.name: c for c in graph.model_calls()}
        missing = [c for c in model_calls if c not in self.calls]
        if missing:
            raise ValueError(f"the plan does not cover call(s) {missing} of graph {graph.name!r}")
        unknown = [c for c in self.calls if c not in model_calls]
        if unknown:
            raise ValueError(f"the plan names call(s) {unknown} that graph {graph.name!r} does not have")
        for name, cp in self.calls.items():
            call = model_calls[name]
            too_high = [r for r in cp.layout.ranks if r >= num_devices]
            if too_high:
                raise ValueError(f"call {name!r} uses device(s) {too_high} but only {num_devices} exist")
            cfg = models[call.model]
            try:
                check_layout(cfg, cp.layout)
            except ValueError as e:
                raise ValueError(f"call {name!r} ({call.model}): {e}") from None
            if call.kind is Kind.GENERATE and cp.layout.pp != 1:
                raise ValueError(f"call {name!r}: generation runs with pp=1, got {cp.layout}")
            if cp.tp_targets and call.kind is not Kind.GENERATE:
                raise ValueError(f"call {name!r}: tp_targets apply to generate calls only")
            previous = cp.layout
            for target in cp.tp_targets:
                check_merge(previous, target)
                try:
                    check_layout(cfg, target)
                except ValueError as e:
                    raise ValueError(f"call {name!r} target {target}: {e}") from None
                previous = target

    # ----- files ------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        data: dict[str, Any] = {"calls": {name: cp.to_dict() for name, cp in self.calls.items()}}
        if self.notes:
            data["notes"] = dict(self.notes)
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_dict(cls, raw: Any, where: str = "plan") -> "ExecutionPlan":
        if not isinstance(raw, dict) or not isinstance(raw.get("calls"), dict):
            raise ValueError(f"{where} must be a mapping with a 'calls' mapping")
        unknown = set(raw) - {"calls", "notes"}
        if unknown:
            raise ValueError(f"{where} has unknown top-level keys {sorted(unknown)}")
        calls = {name: CallPlan.from_dict(name, entry) for name, entry in raw["calls"].items()}
        return cls(calls, raw.get("notes") or {})

    @classmethod
    def load(cls, path: str | Path) -> "ExecutionPlan":
        return cls.from_dict(read_yaml(path, "plan file"), where=f"plan file {path}")


def check_merge(src: Layout, dst: Layout) -> None:
    """``dst`` must merge DP replicas of ``src`` into wider tp groups (adaptive TP) so that every
    rank keeps a sub-slice of the weights it holds: each dst replica is a union of src replicas,
    and a rank with src tp index t gets a dst tp index j with j // factor == t."""
    factor = dst.tp // src.tp if dst.tp % src.tp == 0 else 0
    if set(dst.ranks) != set(src.ranks) or src.pp != 1 or dst.pp != 1 or factor < 2 or src.dp % factor:
        raise ValueError(f"{dst} is not reachable from {src} by merging replicas: same ranks, pp=1, and tp "
                         "growing by a factor that divides dp")
    for d in range(dst.dp):
        members = dst.replica_ranks(d)
        replicas = {src.coord(r).dp for r in members}
        whole = all(set(src.replica_ranks(s)) <= set(members) for s in replicas)
        nested = all(dst.coord(r).tp // factor == src.coord(r).tp for r in members)
        if not (whole and nested):
            raise ValueError(f"{dst} is not an in-place merge of {src}; start from "
                             f"{split_replicas(dst, factor)} instead")


def symmetric_plan(graph: Graph, num_devices: int, *, pp: int = 1, tp: int = 1) -> ExecutionPlan:
    """Every model call on all devices in one layout (DeepSpeed-Chat / OpenRLHF style colocation);
    generation uses the same tp with pp folded into dp."""
    if num_devices % (pp * tp):
        raise ValueError(f"pp*tp = {pp * tp} does not divide {num_devices} devices")
    ranks = tuple(range(num_devices))
    calls = {}
    for c in graph.model_calls():
        if c.kind is Kind.GENERATE:
            layout = Layout(ranks, pp=1, dp=num_devices // tp, tp=tp)
        else:
            layout = Layout(ranks, pp=pp, dp=num_devices // (pp * tp), tp=tp)
        calls[c.name] = CallPlan(layout=layout)
    return ExecutionPlan(calls)
