"""W&B and MLflow loggers: what they are given (the config, the plan, each iteration's numbers),
a resumed run continuing the same logger run, and the real packages' offline stores when they are
installed."""

from __future__ import annotations

import json
import sys
import types

import pytest

from shardflow.config.experiment import MlflowConfig, WandbConfig
from shardflow.runtime.loggers import MlflowSink, WandbSink, flat_params, mlflow_name
from shardflow.runtime.metrics import MetricsLogger

CONFIG = {"algorithm": {"name": "grpo", "kl": {"coef": 0.001}}, "run": {"tags": ["a"]}}


class FakeWandbRun:
    def __init__(self, calls, **kwargs):
        self.calls, self.kwargs = calls, kwargs
        calls.append(("init", kwargs))

    def log(self, metrics, step):
        self.calls.append(("log", step, dict(metrics)))

    def save(self, path, base_path, policy):
        self.calls.append(("save", path))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    module = types.SimpleNamespace(init=lambda **kw: FakeWandbRun(calls, **kw))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_gets_the_config_the_plan_and_numbers_and_resumes_its_run(tmp_path, fake_wandb):
    plan = tmp_path / "plan.yaml"
    plan.write_text("calls: {}\n")
    sink = WandbSink(WandbConfig(enabled=True, tags=["x"]), tmp_path, "myrun", CONFIG, plan, resume=False)
    with MetricsLogger(tmp_path, tensorboard=False, console=False, sinks=[sink]) as metrics:
        metrics.log(1, {"reward": {"mean": 0.5}, "note": "text", "time/iteration": 2})
    (_, init), (_, saved), (_, step, numbers), (finish,) = fake_wandb
    assert init["config"] == CONFIG and init["name"] == "myrun" and init["mode"] == "offline"
    assert init["project"] == "shardflow" and init["tags"] == ["x"] and init["resume"] == "allow"
    assert saved == str(plan) and finish == "finish"
    assert step == 1 and numbers == {"reward/mean": 0.5, "time/iteration": 2}  # numbers only
    WandbSink(WandbConfig(enabled=True), tmp_path, "myrun", CONFIG, None, resume=True)
    assert fake_wandb[-1][1]["id"] == init["id"]  # the same W&B run
    WandbSink(WandbConfig(enabled=True), tmp_path, "myrun", CONFIG, None, resume=False)
    assert fake_wandb[-1][1]["id"] != init["id"]  # a fresh start is a new one


def test_mlflow_names_and_params():
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4" and mlflow_name("time/realloc/actor") == "time/realloc/actor"
    assert flat_params(CONFIG) == {"algorithm.name": "grpo", "algorithm.kl.coef": "0.001", "run.tags": "['a']"}


def test_real_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    plan = tmp_path / "plan.yaml"
    plan.write_text("calls: {}\n")
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "run", CONFIG, plan, resume=False)
    sink.log(1, {"reward/mean": 0.5, "eval/pass@1": 0.25})
    sink.close()
    run_id = json.loads((tmp_path / "wandb_run.json").read_text())["id"]
    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    assert (run_dir / f"run-{run_id}.wandb").stat().st_size > 0
    assert (run_dir / "files" / "plan.yaml").read_text() == "calls: {}\n"


def test_real_mlflow_local_store(tmp_path):
    pytest.importorskip("mlflow")
    import mlflow

    plan = tmp_path / "plan.yaml"
    plan.write_text("calls: {}\n")
    for step, resume in ((1, False), (2, True)):  # a resumed run continues the same MLflow run
        sink = MlflowSink(MlflowConfig(enabled=True), tmp_path, "run", CONFIG, plan, resume=resume)
        sink.log(step, {"reward/mean": 0.25 * step, "eval/pass@4": 0.5})
        sink.close()
    state = json.loads((tmp_path / "mlflow_run.json").read_text())
    client = mlflow.tracking.MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["id"])
    assert run.data.params["algorithm.kl.coef"] == "0.001"
    assert [(m.step, m.value) for m in client.get_metric_history(state["id"], "reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["eval/pass_at_4"] == 0.5
    assert sorted(a.path for a in client.list_artifacts(state["id"])) == ["config.json", "plan.yaml"]
