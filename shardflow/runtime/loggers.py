"""Metric loggers beside the JSONL file and TensorBoard: Weights & Biases and MLflow.

Each is optional (its package is checked before any rank starts, ``runtime.validate``), gets the
run's config and plan when it starts and every iteration's numbers after. A resumed run continues
the same W&B or MLflow run: its id is kept in ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path
from typing import Any, Protocol

from shardflow.config.experiment import ExperimentConfig, MlflowConfig, WandbConfig


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def config_sinks(config: ExperimentConfig, out_dir: Path, plan_file: Path | None, *, resume: bool) -> list[Sink]:
    """The loggers the run's settings turn on, each given the config and the plan."""
    tree, name = dataclasses.asdict(config), config.run.name
    sinks: list[Sink] = []
    if config.run.wandb.enabled:
        sinks.append(WandbSink(config.run.wandb, out_dir, name, tree, plan_file, resume=resume))
    if config.run.mlflow.enabled:
        sinks.append(MlflowSink(config.run.mlflow, out_dir, name, tree, plan_file, resume=resume))
    return sinks


def _saved_id(path: Path, **expected: str) -> str | None:
    """The run id saved in ``path`` when its other fields match ``expected``."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved.get("id") if all(saved.get(k) == v for k, v in expected.items()) else None


class WandbSink:
    """A W&B run (offline by default: files under ``out_dir/wandb`` that ``wandb sync`` uploads)."""

    def __init__(self, settings: WandbConfig, out_dir: Path, name: str, config: dict[str, Any],
                 plan_file: Path | None, *, resume: bool):
        import wandb

        state = out_dir / "wandb_run.json"
        run_id = (_saved_id(state, project=settings.project) if resume else None) or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=settings.project, entity=settings.entity or None, name=name, id=run_id,
                              resume="allow", mode=settings.mode, dir=str(out_dir), config=config,
                              tags=[str(t) for t in settings.tags])
        state.write_text(json.dumps({"id": run_id, "project": settings.project}))
        if plan_file is not None and plan_file.is_file():
            self.run.save(str(plan_file), base_path=str(plan_file.parent), policy="now")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow accepts letters, digits and _ - . space : / in metric names
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_name(key: str) -> str:
    """A metric key as MLflow accepts it: ``eval/pass@4`` -> ``eval/pass_at_4``."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """A nested settings dict as dotted keys with text values (MLflow's params)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flat_params(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(tree)[:500]}


class MlflowSink:
    """An MLflow run in ``settings.tracking_uri`` (default: a local store, ``out_dir/mlflow.db`` with
    the artifacts in ``out_dir/mlartifacts``: ``mlflow ui --backend-store-uri sqlite:///...`` shows it)."""

    def __init__(self, settings: MlflowConfig, out_dir: Path, name: str, config: dict[str, Any],
                 plan_file: Path | None, *, resume: bool):
        import mlflow

        self.mlflow = mlflow
        local = not settings.tracking_uri
        uri = settings.tracking_uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        mlflow.set_tracking_uri(uri)
        if local and mlflow.get_experiment_by_name(settings.experiment) is None:  # artifacts beside the store
            artifacts = (out_dir / "mlartifacts").resolve().as_uri()
            mlflow.create_experiment(settings.experiment, artifact_location=artifacts)
        experiment = mlflow.set_experiment(settings.experiment)
        state = out_dir / "mlflow_run.json"
        run_id = _saved_id(state, tracking_uri=uri, experiment=settings.experiment) if resume else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name,
                                    experiment_id=experiment.experiment_id)
        state.write_text(json.dumps({"id": self.run.info.run_id, "tracking_uri": uri,
                                     "experiment": settings.experiment}))
        if run_id is None:
            params = flat_params(config)
            keys = sorted(params)
            for start in range(0, len(keys), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params({k: params[k] for k in keys[start:start + 100]})
            mlflow.log_dict(config, "config.json")
            if plan_file is not None and plan_file.is_file():
                mlflow.log_artifact(str(plan_file))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
