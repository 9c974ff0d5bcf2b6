"""``shardflow eval CONFIG.yaml [key.sub=value ...] [--checkpoint DIR]``: the held-out evaluation alone.

Evaluates ``models.actor`` (or the checkpoint given: a model directory, or a run's ``iter-N``
checkpoint) on ``eval.path`` or ``eval.dataset`` with the config's reward and sampling settings,
as training evaluates it: a greedy pass (pass@1) and ``eval.samples`` samples per prompt
(mean@k, pass@k). The generate call runs in the plan's layout for ``actor_gen`` (or on all
``run.devices``). Writes the metrics as JSON and a line per prompt beside them.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from shardflow.cli.train import load_train_config
from shardflow.parallel.launch import launch
from shardflow.runtime import checkpointing
from shardflow.runtime.driver import eval_rank
from shardflow.runtime.validate import prepare_eval

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="a YAML config file (the shipped example's without one), then key.sub=value overrides")
    p.add_argument("--example", default="arithmetic", help="the shipped example to use without a config file")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the model to evaluate instead of models.actor: a model directory, a run's checkpoint "
                        "(run.out_dir/checkpoints/iter-N) or 'latest' (the run's latest checkpoint)")
    p.add_argument("--out", type=Path, default=None,
                   help="the metrics file (JSON; default: run.out_dir/eval/<checkpoint>.json); the responses go "
                        "beside it (.jsonl)")


def run(args: argparse.Namespace) -> None:
    config = load_train_config(args.args, args.example)
    checkpoint = args.checkpoint
    if checkpoint is not None and str(checkpoint) == "latest":
        checkpoint = checkpointing.latest(config.run.output_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"--checkpoint latest: {config.run.output_dir} has no checkpoint")
    prepared = prepare_eval(config, checkpoint)
    name = checkpoint.name if checkpoint is not None else "actor"
    out = args.out or config.run.output_dir / "eval" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    actor = prepared.config.models["actor"].path
    logger.info(f"shardflow eval: {actor} on {len(prepared.eval_prompts)} prompts, {config.run.devices} "
                f"{prepared.backend} rank(s), actor_gen in {prepared.plan['actor_gen'].layout}")
    launch(eval_rank, config.run.devices, prepared, out, backend=prepared.backend,
           log_dir=config.run.output_dir / "logs")
    scores = json.loads(out.read_text())
    logger.info("  ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in scores.items() if k.startswith("eval/")))
    logger.info(f"metrics in {out}, responses in {out.with_suffix('.jsonl')}")
