"""What one adaptive generation did: active batch and layout per decode step, switches, refusals.

Kept on the layout's first rank (the one that decides). ``metrics`` gives scalars for the run's
metrics log; ``plot_trace`` draws active batch and layout per decode step (the picture of the
aligned phase and the long tail).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class SwitchRecord:
    step: int  # decode step at which the switch happened
    source: str
    target: str
    kv_mode: str
    total_s: float
    requests: int = 0  # active requests of the first rank's merged replica
    between_turns: int = 0  # its episodes waiting on their environments (they travel without KV)
    weights_s: float = 0.0  # seconds on the first rank, by part
    requests_s: float = 0.0  # exchanging request states
    kv_s: float = 0.0
    groups_s: float = 0.0  # communication groups are created before generation: looked up only
    graphs_s: float = 0.0
    weight_bytes: int = 0  # reallocated to the busiest rank (0 when the target nests: views)
    kv_bytes: int = 0  # KV received by migration on the first rank
    extra_bytes_bound: int = 0  # most extra memory the switch's buffers take on the first rank
    peak_extra_bytes: int | None = None  # measured (CUDA): peak allocated during the switch minus before
    predicted_saving_s: float | None = None
    predicted_cost_s: float | None = None


@dataclass(kw_only=True)
class Refusal:
    step: int  # -1: when the generator was built
    target: str
    reason: str


@dataclass(kw_only=True)
class GenerationTrace:
    """One generation; ``from_dict(to_dict())`` round-trips."""

    layouts: list[str]  # the chain: start, then targets
    active: list[int] = field(default_factory=list)  # requests decoded at each step, all replicas
    layout_index: list[int] = field(default_factory=list)  # index into ``layouts`` at each step
    step_seconds: list[float] = field(default_factory=list)  # slowest replica's time of each step
    switches: list[SwitchRecord] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    decisions: int = 0
    decision_seconds: float = 0.0  # the policy's own time, summed
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationTrace":
        return cls(**{**raw, "switches": [SwitchRecord(**s) for s in raw.get("switches", [])],
                      "refusals": [Refusal(**r) for r in raw.get("refusals", [])]})

    def metrics(self) -> dict[str, float]:
        """Scalars for the run's metrics log (``adaptive/...``)."""
        single = sum(1 for a in self.active if a == 1)
        return {
            "adaptive/decode_steps": float(len(self.active)),
            "adaptive/steps_with_one_request_frac": single / max(len(self.active), 1),
            "adaptive/switches": float(len(self.switches)),
            "adaptive/switch_s": sum(s.total_s for s in self.switches),
            "adaptive/switch_refusals": float(len(self.refusals)),
            "adaptive/decision_s": self.decision_seconds,
        }


def plot_trace(trace: GenerationTrace, path: str | Path, title: str = "") -> Path:
    """Active batch per decode step, the background shaded by layout, switches marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    steps = range(len(trace.active))
    colours = plt.get_cmap("tab10")
    start = 0
    for i in range(1, len(trace.layout_index) + 1):
        if i == len(trace.layout_index) or trace.layout_index[i] != trace.layout_index[start]:
            index = trace.layout_index[start]
            ax.axvspan(start, i, color=colours(index), alpha=0.15, lw=0,
                       label=trace.layouts[index] if index not in trace.layout_index[:start] else None)
            start = i
    ax.plot(steps, trace.active, color="black", lw=1)
    for s in trace.switches:
        ax.axvline(s.step, color="red", lw=1, ls="--")
        ax.annotate(f"{s.source} -> {s.target}\n{s.kv_mode}, {s.total_s * 1e3:.0f} ms",
                    (s.step, max(trace.active or [1])), fontsize=7, ha="left", va="top", color="red")
    ax.set_xlabel("decode step")
    ax.set_ylabel("active requests")
    ax.set_title(title or "generation: active batch and layout per decode step")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
