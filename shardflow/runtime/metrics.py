"""Per-iteration metrics: one readable console line, a JSONL file, TensorBoard scalars and the
loggers of ``runtime.loggers`` (W&B, MLflow).

Keys are slash-separated names so that TensorBoard groups them: ``reward/*`` and
``response_length/*`` from ``rollout_metrics``, a train call's stats under its model
(``actor/policy_loss``, ``actor/grad_norm``, ``critic/value_loss``), times under ``time/``
(``time/actor_gen``, ``time/realloc/actor``, ``time/iteration``). Whatever a call reports is passed
through under its own name. Only one rank (the driver's rank 0) should own a ``MetricsLogger``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from shardflow.runtime.loggers import Sink

logger = logging.getLogger(__name__)

# the short console line: the keys a reader follows run by run, with a short label
CONSOLE_SHORT = (
    ("reward/mean", "reward"), ("reward/std", "±"), ("response_length/mean", "len"), ("actor/kl", "kl"),
    ("reward/errors", "reward errors"), ("actor/nll", "nll"), ("actor/dpo_loss", "dpo loss"),
    ("actor/dpo_accuracy", "acc"), ("rollout/turns_mean", "turns"), ("time/iteration", "time"),
)
# the full line (--log-level debug) begins with these; the rest follow in sorted order
CONSOLE_FIRST = (
    ("reward/mean", "reward"), ("reward/std", "±"), ("response_length/mean", "len"),
    ("response_length/max", "max"), ("response_length/clip_ratio", "clip"), ("actor/kl", "kl"),
    ("actor/policy_loss", "pg"), ("critic/value_loss", "vf"), ("actor/grad_norm", "gnorm"),
    ("time/iteration", "time"),
)
# held-out evaluation: the accuracies (both lines)
CONSOLE_EVAL = ("eval/pass@", "eval/mean@")
# other keys worth a place on the console, by their last part (everything goes to JSONL and TensorBoard)
CONSOLE_ALSO = ("policy_loss", "value_loss", "grad_norm", "clip_frac", "entropy", "kl", "lr", "tokens_per_s")


def rollout_metrics(response_lengths: list[int], prompt_lengths: list[int], rewards: list[float], *,
                    max_new_tokens: int) -> dict[str, float]:
    """Response length (mean, max, min, fraction cut at ``max_new_tokens``), prompt length and
    reward statistics of an iteration's rollouts, from one entry per sequence."""
    response = torch.tensor(response_lengths, dtype=torch.float64)
    out = {
        "response_length/mean": float(response.mean()),
        "response_length/max": float(response.max()),
        "response_length/min": float(response.min()),
        "response_length/clip_ratio": float((response >= max_new_tokens).double().mean()),
        "prompt_length/mean": float(torch.tensor(prompt_lengths, dtype=torch.float64).mean()),
    }
    if rewards:
        r = torch.tensor(rewards, dtype=torch.float64)
        out.update({"reward/mean": float(r.mean()), "reward/std": float(r.std(unbiased=False)),
                    "reward/min": float(r.min()), "reward/max": float(r.max())})
    return out


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become slash-separated keys; 0-d tensors become floats."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
            out[name] = value.item()
        else:
            out[name] = value
    return out


def format_line(step: int, metrics: dict[str, Any], *, full: bool = True) -> str:
    """``iter 12 reward 0.53 ± 0.5 len 4.1 max 9 clip 0% ... | actor_gen 1.2s ... | actor/lr 1e-06``:
    the main numbers, then the other times, then other losses, norms and rates; not ``full``:
    ``iter 12 reward 0.53 ± 0.5 len 4.1 kl 0.002 time 1.2s`` (what the console shows by default)."""
    parts, shown = [f"iter {step}"], set()
    for key, label in CONSOLE_FIRST if full else CONSOLE_SHORT:
        if key in metrics:
            value = metrics[key]
            text = f"{100 * value:.0f}%" if key.endswith("clip_ratio") else _number(value)
            parts.append(f"{label} {text}" + ("s" if key.startswith("time/") else ""))
            shown.add(key)
    evaluation = [f"{k.removeprefix('eval/')} {_number(v)}" for k, v in sorted(metrics.items())
                  if k.startswith(CONSOLE_EVAL)]
    if evaluation:
        parts.append("| eval " + " ".join(evaluation))
        shown.update(k for k in metrics if k.startswith(CONSOLE_EVAL))
    if not full:
        return " ".join(parts)
    times = [f"{k.removeprefix('time/')} {_number(v)}s" for k, v in sorted(metrics.items())
             if k.startswith("time/") and k not in shown]
    rest = [f"{k} {_number(v)}" for k, v in sorted(metrics.items())
            if k not in shown and k.rsplit("/", 1)[-1] in CONSOLE_ALSO and _is_number(v)]
    return " | ".join([" ".join(parts)] + ([" ".join(times)] if times else []) + rest)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any) -> str:
    if not _is_number(value):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e6):
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


class MetricsLogger:
    """Writes each iteration's metrics to ``out_dir/metrics.jsonl`` (one JSON object per line,
    flushed at once), TensorBoard events under ``out_dir/tensorboard`` and a console line (logged:
the short one, or every number at ``--log-level debug``).

    ``resume_step``: the last iteration a resumed run already has; lines and events after it,
    written by the run that was killed after its checkpoint, are dropped.
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, console: bool = True,
                 resume_step: int | None = None, sinks: Sequence[Sink] = ()):
        self.sinks = list(sinks)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        if resume_step is not None:
            _truncate_jsonl(self.jsonl_path, resume_step)
        self.console = console
        self._file = self.jsonl_path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("run.tensorboard needs the tensorboard package (pip install tensorboard), "
                                 "or set run.tensorboard=false") from e
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record ``metrics`` (nested dicts and scalar tensors allowed) for iteration ``step``."""
        flat = flatten(metrics)
        record = {"step": step, "time": time.time(), **flat}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in flat.items():
                if _is_number(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        numbers = {k: v for k, v in flat.items() if _is_number(v)}
        for sink in self.sinks:
            sink.log(step, numbers)
        if self.console:
            logger.info(format_line(step, flat, full=logger.isEnabledFor(logging.DEBUG)))
        return flat

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of steps up to ``last_step`` (and drop a half-written last line)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a kill cut short
        if record.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
