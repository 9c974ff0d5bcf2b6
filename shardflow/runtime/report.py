"""One iteration's summary, merged from every rank's call reports.

Every rank calls ``merge_reports`` on the same gathered list, so every rank sees the same numbers
(the adaptive KL controller depends on that). Keys starting with ``_`` carry data for the pictures
and are not logged.
"""

from __future__ import annotations

import statistics

from shardflow.config.experiment import ExperimentConfig
from shardflow.rl.graph import Graph, Kind
from shardflow.runtime.metrics import rollout_metrics


def merge_reports(per_rank: list[dict], graph: Graph, plan, config: ExperimentConfig) -> dict:
    summary: dict[str, float | dict] = {}
    spans = [(name, rank, r.span) for rank, reports in enumerate(per_rank) for name, r in reports.items() if r.span]
    t0 = min((s[0] for _, _, s in spans), default=0.0)
    t1 = max((s[1] for _, _, s in spans), default=0.0)
    summary["time/iteration"] = t1 - t0
    for call in graph.order:
        reports = [(rank, reports[call.name]) for rank, reports in enumerate(per_rank) if call.name in reports]
        durations = [r.span[1] - r.span[0] for _, r in reports if r.span]
        if durations:
            summary[f"time/{call.name}"] = max(durations)
        errors = [text for _, r in reports for text in r.errors]
        if errors:  # contained failures: the first one is said (their counts are metrics)
            summary.setdefault("_errors", []).append(f"{call.name}: {errors[0]}")
        if "reward/errors" in (key for _, r in reports for key in r.metrics):
            summary["reward/errors"] = sum(r.metrics.get("reward/errors", 0.0) for _, r in reports)
        for key in (f"time/compile/{call.name}", f"time/jit/{call.name}", f"time/precompile_wait/{call.name}"):
            compiled = [r.metrics[key] for _, r in reports if key in r.metrics]
            if compiled:  # the slowest rank's compilation inside the call (or wait for its helper)
                summary[key] = max(compiled)
        for key in (f"compile/{call.name}/graphs_cached", f"compile/{call.name}/graphs_built"):
            if any(key in r.metrics for _, r in reports):  # graphs compiled by all ranks
                summary[key] = sum(r.metrics.get(key, 0.0) for _, r in reports)
        key = f"memory/{call.name}/peak_gb"
        peaks = [r.metrics[key] for _, r in reports if key in r.metrics]
        if peaks:  # GPU runs: the largest rank's peak
            summary[key] = max(peaks)
        if call.kind is Kind.FUNCTION:
            continue
        realloc = [r.metrics.get(f"time/realloc/{call.name}", 0.0) for _, r in reports]
        summary[f"time/realloc/{call.name}"] = max(realloc, default=0.0)
        moved = sum(r.metrics.get(f"realloc/{call.name}/bytes", 0.0) for _, r in reports)
        if moved:
            summary[f"realloc/{call.name}/gbytes"] = moved / 1e9
        if call.kind is Kind.GENERATE:
            # every tp rank of a replica counts the same tokens: count tp index 0 only
            layout = plan[call.name].layout
            tokens = sum(r.metrics.get("generation/tokens", 0.0) for rank, r in reports
                         if rank in layout and layout.coord(rank).tp == 0)
            seconds = max((r.metrics.get("generation/seconds", 0.0) for _, r in reports), default=0.0)
            summary["generation/tokens"] = tokens
            _rollout_work(summary, [r for _, r in reports])
            if seconds > 0:
                summary["generation/tokens_per_s"] = tokens / seconds
            # where the call's time goes: cache and weight copies, prefill, decode steps
            for part in ("setup", "prefill"):
                values = [r.metrics[f"generation/{part}_seconds"] for _, r in reports
                          if f"generation/{part}_seconds" in r.metrics]
                if values:
                    summary[f"time/{call.name}/{part}"] = max(values)
            steps = max((r.decode_steps for _, r in reports), key=len, default=[])
            if steps:
                summary[f"time/{call.name}/decode"] = sum(s for _, s in steps)
                summary[f"time/{call.name}/decode_step"] = statistics.median(s for _, s in steps)
            for _, r in reports:  # adaptive TP: the layout's first rank reports its switches
                summary.update({k: v for k, v in r.metrics.items() if k.startswith("adaptive/")})
                if r.adaptive is not None:
                    summary.setdefault("_adaptive", {})[call.name] = r.adaptive
        if call.kind is Kind.TRAIN:
            # the engine's step metrics are global; the loss stats exist on the last stage only
            for _, r in reports:
                for key, value in r.metrics.items():
                    if key.startswith(f"{call.model}/") and key not in summary:
                        summary[key] = value

    rollout = {"response_length": [], "prompt_length": [], "reward": []}
    for reports in per_rank:
        for r in reports.values():
            for key in rollout:
                rollout[key] += r.rollout.get(key, [])
    if rollout["response_length"]:
        summary.update(rollout_metrics(rollout["response_length"], rollout["prompt_length"], rollout["reward"],
                                       max_new_tokens=config.generation.max_new_tokens))
    summary.update(episode_metrics(per_rank))
    summary["_spans"] = [(name, rank, s[0] - t0, s[1] - t0) for name, rank, s in spans]
    summary["_decode"] = {f"{name} @ rank {rank}": r.decode_steps for rank, reports in enumerate(per_rank)
                          for name, r in reports.items() if r.decode_steps}
    return summary


def _rollout_work(summary: dict, reports: list) -> None:
    """Seconds the holders' worker pools spent on environments and rewards, summed over the
    holders (only they report them), and the share of it hidden behind decoding: what the ranks
    did not wait for."""
    for key in sorted({k for r in reports for k in r.metrics if k.startswith(("rollout/", "time/rollout/"))}):
        summary[key] = summary.get(key, 0.0) + sum(r.metrics.get(key, 0.0) for r in reports)
    busy = summary.get("time/rollout/environments", 0.0) + summary.get("time/rollout/rewards", 0.0)
    if busy > 0:
        summary["time/rollout/hidden_share"] = max(0.0, 1.0 - summary.get("time/rollout/waited", 0.0) / busy)


EPISODE_LISTS = ("turns", "tool_calls", "tool_errors", "observation_tokens")


def episode_metrics(per_rank: list[dict]) -> dict[str, float]:
    """Per-episode facts (turns, tool calls and errors, observation tokens) and each reward term's
    mean, from the holders' per-sequence lists."""
    lists: dict[str, list] = {}
    for reports in per_rank:
        for r in reports.values():
            for key, values in r.rollout.items():
                if key in EPISODE_LISTS or key.startswith("reward_term/"):
                    lists.setdefault(key, []).extend(values)
    out: dict[str, float] = {}
    for key, values in lists.items():
        if not values:
            continue
        if key.startswith("reward_term/"):
            out[f"reward/{key.split('/', 1)[1]}"] = statistics.fmean(values)
        elif key == "turns":
            out["rollout/turns_mean"] = statistics.fmean(values)
            out["rollout/turns_max"] = float(max(values))
        else:
            out[f"rollout/{key}"] = float(sum(values))
    return out
