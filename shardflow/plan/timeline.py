"""A picture of a simulated plan: calls as bars on devices over time (PNG, matplotlib Agg).

Each event covers the rows of its devices (device 0 at the top), so a thousand-GPU plan is drawn
as a few large blocks rather than a thousand rows. Reallocation is hatched, data movement pale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from shardflow.plan.simulator import Event


def _runs(devices: tuple[int, ...]) -> list[tuple[int, int]]:
    """Contiguous runs (first, count) of sorted ranks."""
    runs: list[tuple[int, int]] = []
    for r in devices:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def draw_timeline(events: Sequence[Event], num_devices: int, path: str | Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    calls = list(dict.fromkeys(e.call for e in events))
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(calls)}
    end = max((e.end for e in events), default=1.0)
    fig, ax = plt.subplots(figsize=(12, min(2 + 0.35 * num_devices, 9)))
    for e in events:
        style = {"realloc": dict(alpha=0.5, hatch="///"), "data": dict(alpha=0.3), "compute": dict(alpha=0.9)}[e.phase]
        for first, count in _runs(tuple(sorted(e.devices))):
            ax.broken_barh([(e.start, e.end - e.start)], (first, count), facecolors=colors[e.call],
                           edgecolor="black", linewidth=0.3, **style)
            if e.phase == "compute" and (e.end - e.start) > 0.04 * end:
                ax.text((e.start + e.end) / 2, first + count / 2, e.call, ha="center", va="center", fontsize=7,
                        clip_on=True)
    ax.set_ylim(num_devices, 0)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds")
    ax.set_ylabel("device")
    handles = [Patch(facecolor=colors[c], label=c) for c in calls]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="///", label="reallocation")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
