"""Rollout statistics, the console line, and the JSONL and TensorBoard files."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from shardflow.runtime.metrics import MetricsLogger, flatten, format_line, rollout_metrics


def test_rollout_metrics_by_hand():
    # responses of 1, 3 and 4 tokens after prompts of 2, 1 and 2; the limit is 4 new tokens
    m = rollout_metrics([1, 3, 4], [2, 1, 2], [1.0, 0.0, 0.5], max_new_tokens=4)
    assert m["response_length/mean"] == pytest.approx(8 / 3)
    assert (m["response_length/max"], m["response_length/min"]) == (4.0, 1.0)
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(5 / 3)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx((0.5 / 3) ** 0.5)  # population std: sqrt((0.25 + 0.25 + 0) / 3)
    assert (m["reward/min"], m["reward/max"]) == (0.0, 1.0)


def test_flatten_and_console_line():
    flat = flatten({"actor": {"policy_loss": torch.tensor(-0.25), "grad_norm": 1.5}, "reward/mean": 0.5,
                    "time": {"actor_gen": 2.0, "iteration": 3.25}, "note": "warm"})
    assert flat == {"actor/policy_loss": -0.25, "actor/grad_norm": 1.5, "reward/mean": 0.5,
                    "time/actor_gen": 2.0, "time/iteration": 3.25, "note": "warm"}
    line = format_line(7, {**flat, "response_length/clip_ratio": 0.125, "gen/tokens_per_s": 1234.5678})
    assert line.startswith("iter 7 reward 0.5 clip 12% pg -0.25 gnorm 1.5 time 3.25s")
    assert "actor_gen 2s" in line and "gen/tokens_per_s 1235" in line and "note" not in line
    short = format_line(7, {**flat, "response_length/mean": 4.25, "actor/kl": 0.002}, full=False)
    assert short == "iter 7 reward 0.5 len 4.25 kl 0.002 time 3.25s"  # the default console line
    with pytest.raises(ValueError, match="metric 'x' is a tensor of shape \\(2,\\), not a scalar"):
        flatten({"x": torch.zeros(2)})


def read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logger_writes_jsonl_tensorboard_and_console(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shardflow")
    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": 0.1 * step, "time": {"actor_gen": 1.0}, "plan": "symmetric"})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[1]["reward/mean"] == pytest.approx(0.2) and lines[1]["plan"] == "symmetric"
    assert caplog.messages[2].startswith("iter 3 reward 0.3")
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3]
    assert scalars["reward/mean"][2][1] == pytest.approx(0.3)
    assert "plan" not in scalars  # text stays in the JSONL


def test_resumed_logger_drops_what_came_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"reward/mean": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # a line cut by a kill
    with MetricsLogger(tmp_path, console=False, resume_step=2) as logger:
        logger.log(3, {"reward/mean": 30.0})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert read_scalars(tmp_path / "tensorboard")["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_iteration_summary_splits_generation_time():
    """A generate call's time is reported as setup, prefill and decode (the sum and the median
    step) of its slowest rank, under the call's name."""
    from shardflow.config.load import load_config
    from shardflow.plan.execution_plan import symmetric_plan
    from shardflow.runtime.calls.context import CallReport
    from shardflow.runtime.report import merge_reports
    from shardflow.runtime.validate import check_config

    config = load_config(None, base={"models": {"actor": {"path": "x"}}, "data": {"path": "x"},
                                     "generation": {"samples_per_prompt": 2}})
    graph = check_config(config).graph
    gen = next(c for c in graph.model_calls() if c.kind.name == "GENERATE")
    plan = symmetric_plan(graph, 2)

    def report(setup, prefill, steps, compiled=None):
        return {gen.name: CallReport(metrics={"generation/tokens": 6.0, "generation/seconds": 1.0,
                                              "generation/setup_seconds": setup,
                                              "generation/prefill_seconds": prefill,
                                              **(compiled or {})},
                                     decode_steps=steps, span=(0.0, 1.0))}

    name = gen.name
    first = {f"time/precompile_wait/{name}": 2.5, f"compile/{name}/graphs_cached": 4.0,
             f"compile/{name}/graphs_built": 1.0}
    summary = merge_reports([report(0.3, 0.1, [(2, 0.4)], first),
                             report(0.1, 0.2, [(2, 0.5), (2, 0.1), (1, 0.2)], {f"compile/{name}/graphs_built": 4.0})],
                            graph, plan, config)
    assert summary[f"time/{name}/setup"] == pytest.approx(0.3)
    assert summary[f"time/{name}/prefill"] == pytest.approx(0.2)
    assert summary[f"time/{name}/decode"] == pytest.approx(0.8)  # the rank with the most steps
    assert summary[f"time/{name}/decode_step"] == pytest.approx(0.2)
    assert summary[f"time/precompile_wait/{name}"] == 2.5  # the longest wait for a compiling helper
    assert (summary[f"compile/{name}/graphs_cached"], summary[f"compile/{name}/graphs_built"]) == (4.0, 5.0)


def test_generation_picture_draws_one_line_per_replica(tmp_path):
    from shardflow.runtime.pictures import draw_generation, replica_lines

    decode = {"actor_gen @ rank 0": [(4, 0.1), (3, 0.1)], "actor_gen @ rank 1": [(4, 0.1), (3, 0.1)],
              "actor_gen @ rank 2": [(4, 0.1), (1, 0.1), (1, 0.1)]}
    assert replica_lines(decode) == {"actor_gen @ ranks 0, 1": [4, 3], "actor_gen @ rank 2": [4, 1, 1]}
    draw_generation(decode, tmp_path / "generation.png")
    assert (tmp_path / "generation.png").stat().st_size > 0
