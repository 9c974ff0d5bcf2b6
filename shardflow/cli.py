"""``shardflow`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys

from shardflow.generate_cli import add_parser as add_generate_parser
from shardflow.runtime.launch import RankFailed
from shardflow.runtime.train_cli import add_parser as add_train_parser


def _demo(args: argparse.Namespace) -> None:
    from shardflow.runtime.demo import run_demo

    run_demo(args.out, nprocs=args.nprocs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="load a tiny model across CPU ranks and check it against transformers")
    demo.add_argument("--out", default="runs/demo", help="directory for the tiny checkpoint")
    demo.add_argument("--nprocs", type=int, default=4, help="ranks to spawn (4 gives pp=2 x tp=2)")
    demo.set_defaults(run=_demo)
    add_generate_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except RankFailed as e:
        print(f"shardflow: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"shardflow: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
