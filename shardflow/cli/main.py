"""``shardflow`` command line: one subcommand per job, registered in ``COMMANDS``.

A command is a module with a docstring (its ``--help`` description), ``add_arguments(parser)``
and ``run(args)``. Only the command being run is imported, so that a pure-Python command
(``shardflow plan``) starts without loading torch. Adding a command is one module plus one entry.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass

from shardflow.engine.generate import precompile_launch
from shardflow.parallel.failures import RankFailed
from shardflow.parallel.logs import setup_logging

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    module: str  # defines add_arguments(parser) and run(args)
    summary: str  # one line for ``shardflow --help``


COMMANDS: dict[str, Command] = {
    "train": Command("shardflow.cli.train", "run an RL algorithm per an execution plan (the shipped example "
                                            "when no config is given)"),
    "eval": Command("shardflow.cli.eval", "evaluate a model or checkpoint on held-out prompts (pass@1, mean@k)"),
    "generate": Command("shardflow.cli.generate", "complete the prompts of a JSONL file"),
    "plan": Command("shardflow.cli.plan", "search an execution plan for an experiment on a cluster"),
    "profile": Command("shardflow.cli.profile", "measure layer, decode and link costs of a model shape on this "
                                                "hardware"),
    "demo": Command("shardflow.cli.demo", "load a tiny model across CPU ranks and check it against transformers"),
}


DESCRIPTION = "RL post-training of large language models with per-call parallel layouts."


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with ``only`` of that one alone (the others are listed by
    their summary; ``only=""``: none is loaded)."""
    parser = argparse.ArgumentParser(prog="shardflow", description=DESCRIPTION)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="what reaches the console (rank 0) and the run's log files")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=command.summary)
            continue
        module = importlib.import_module(command.module)
        p = sub.add_parser(name, help=command.summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    only = next((a for a in argv if not a.startswith("-")), None)
    if only == "train" and not {"-h", "--help"} & set(argv):
        precompile_launch.prestart()  # its start overlaps the imports below (a GPU's runs: see the module)
    args = build_parser(only if only in COMMANDS else "").parse_args(argv)
    setup_logging(args.log_level)
    try:
        args.run(args)
    except RankFailed as e:
        logger.error(f"shardflow: {e}")
        return 1
    except (ValueError, FileNotFoundError) as e:
        logger.error(f"shardflow: error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
