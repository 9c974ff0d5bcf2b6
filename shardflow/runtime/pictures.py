"""Pictures of a run: calls on devices over time, and the active batch over decode steps."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_timeline(spans: list[tuple[str, int, float, float]], path: Path) -> None:
    """One row per rank, one bar per call it ran (seconds from the iteration's start)."""
    if not spans:
        return
    plt = _pyplot()
    names = sorted({name for name, *_ in spans}, key=lambda n: min(s[2] for s in spans if s[0] == n))
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    ranks = sorted({rank for _, rank, *_ in spans})
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(ranks) + 1.5))
    for name, rank, start, end in spans:
        ax.barh(rank, end - start, left=start, color=colors[name], edgecolor="black", linewidth=0.3)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the iteration")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names], labels=names,
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(names), 6), fontsize="small")
    ax.set_title("calls on devices over one iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replica_lines(decode: dict[str, list[tuple[int, float]]]) -> dict[str, list[int]]:
    """Active batch per decode step by line: the ranks of one replica decode the same batches,
    so labels ("call @ rank r") whose batches agree become one line ("call @ ranks 0, 1")."""
    lines: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for label, steps in sorted(decode.items()):
        call, _, rank = label.rpartition(" @ rank ")
        lines.setdefault((call, tuple(b for b, _ in steps)), []).append(rank)
    return {f"{call} @ rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}": list(batches)
            for (call, batches), ranks in lines.items()}


def draw_generation(decode: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Active batch per decode step, one line per generating replica."""
    if not decode:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for label, batches in replica_lines(decode).items():
        ax.step(range(len(batches)), batches, where="post", label=label, linewidth=1)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # steps and requests are whole
    ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("decode step")
    ax.set_ylabel("active requests")
    ax.set_title("active batch during generation (last iteration)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
