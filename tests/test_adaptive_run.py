"""``shardflow train`` with adaptive TP on gloo ranks: the plan's tp_targets and
``generation.adaptive.enabled`` turn it on; the run's rollouts and losses are those of the static run
(switches keep every token), its metrics report the switches, and the picture is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardflow.config.load import load_config
from shardflow.examples.arithmetic import CONFIG_FILE, TASK_FILE


def train_job(world, raw: dict, overrides: list[str]):
    from shardflow.runtime.driver import train_rank
    from shardflow.runtime.validate import prepare

    train_rank(world, prepare(load_config(None, overrides, base=raw)))


def test_a_run_with_adaptive_tp_matches_the_static_run(pool, checkpoints, tmp_path):
    model = checkpoints.get("llama", "llama")  # tiny, random, with the character tokenizer
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    raw["models"]["actor"]["path"] = raw["models"]["ref"]["path"] = model
    raw["data"]["path"] = str(TASK_FILE)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"calls": {
        "actor_gen": {"layout": "d4p1t1@0,2,1,3", "tp_targets": ["d2p1t2@0,2,1,3", "d1p1t4@0-3"]},
        "ref_inf": "d2p1t1@2-3", "actor_train": "d1p2t2@0-3"}}))
    # Measured step times that make tp=4 ten times faster than tp=1: the policy switches at once.
    steps = tmp_path / "steps.json"
    table = {"batches": [1, 64], "contexts": [1, 512]}
    steps.write_text(json.dumps({"format": "shardflow-decode-steps/1", "tables": {
        str(tp): {**table, "seconds": [[s, s], [s, s]]} for tp, s in ((1, 1.0), (2, 0.5), (4, 0.1))}}))
    common = [f"plan={plan}", "run.iterations=2", "run.progress=false", "run.tensorboard=false",
              "run.checkpoints=false", "generation.max_new_tokens=8"]
    static, adaptive = tmp_path / "static", tmp_path / "adaptive"
    pool.run(train_job, raw, [*common, f"run.out_dir={static}"])
    pool.run(train_job, raw, [*common, f"run.out_dir={adaptive}", "generation.adaptive.enabled=true",
                              "generation.adaptive.interval=2", f"generation.adaptive.step_times={steps}"])
    a, b = metrics(static), metrics(adaptive)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert y["adaptive/switches"] >= 1 and y["adaptive/switch_refusals"] == 0
        same = {k: v for k, v in x.items() if not k.startswith("time") and k != "generation/tokens_per_s"}
        # The same tokens; their log-probabilities (hence the losses) were computed under another tp,
        # which reorders float32 sums: equal to a few ulps. Near zero (the sequence KL of a policy
        # still equal to its reference: ~1e-7, a sum of such ulps over a response) that is absolute.
        assert same == {k: pytest.approx(y[k], rel=1e-4, abs=1e-6) for k in same}, \
            [(k, x[k], y.get(k)) for k in same if x[k] != pytest.approx(y.get(k), rel=1e-4, abs=1e-6)]
        assert {k: x[k] for k in ("reward/mean", "response_length/mean", "generation/tokens")} == \
            {k: y[k] for k in ("reward/mean", "response_length/mean", "generation/tokens")}
    assert (adaptive / "generation_actor_gen_adaptive.png").stat().st_size > 0


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
