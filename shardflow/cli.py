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


def _plan(args: argparse.Namespace) -> None:
    from shardflow.plan.command import plan_experiment
    from shardflow.plan.search import SearchOptions

    options = SearchOptions(time_limit_s=args.time_limit, max_steps=args.max_steps, chains=args.chains,
                            seed=args.seed, temperature=args.temperature)
    plan_experiment(args.config, args.overrides, devices=args.devices, nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node, out=args.out, profile=args.profile, options=options,
                    use_exhaustive=args.exhaustive, prompt_tokens=args.prompt_tokens,
                    response_mean=args.response_mean, response_std=args.response_std, iterations=args.iterations)


def _profile(args: argparse.Namespace) -> None:
    from shardflow.plan.profiler import run_profile

    run_profile(args.model, args.out, tps=args.tp, quick=args.quick, ranks=args.ranks, device=args.device,
                cuda_graphs=args.cuda_graphs, compile_layers=not args.eager_layers,
                transposed_weights=args.transposed_weights)


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="search an execution plan for an experiment on a cluster")
    plan.add_argument("config", help="experiment YAML")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--devices", type=int, help="GPUs to plan for (default: run.devices)")
    where.add_argument("--nodes", type=int, help="nodes to plan for (with --gpus-per-node)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    plan.add_argument("--time-limit", type=float, default=60.0, help="search time limit in seconds")
    plan.add_argument("--max-steps", type=int, default=None, help="proposals per chain (reproducible stop)")
    plan.add_argument("--chains", type=int, default=4, help="MCMC chains")
    plan.add_argument("--seed", type=int, default=0, help="search seed")
    plan.add_argument("--temperature", type=float, default=0.05, help="MCMC temperature (relative slowdown)")
    plan.add_argument("--exhaustive", action="store_true", help="estimate every plan (small spaces only)")
    plan.add_argument("--profile", help="profile JSON from 'shardflow profile' (default: roofline)")
    plan.add_argument("--out", help="directory for plan.yaml and plan.png (default: the run's out_dir)")
    plan.add_argument("--prompt-tokens", type=int, help="prompt length (default: data.max_prompt_tokens)")
    plan.add_argument("--response-mean", type=float, help="mean response length (default: max_new_tokens / 2)")
    plan.add_argument("--response-std", type=float, help="response length spread (default: max_new_tokens / 4)")
    plan.add_argument("--iterations", type=int, default=3, help="iterations the simulator unrolls")
    plan.set_defaults(run=_plan)

    prof = sub.add_parser("profile", help="measure layer, decode and link costs of a model shape on this hardware")
    prof.add_argument("--model", required=True, help="model directory (config.json is enough)")
    prof.add_argument("--out", default="profile.json", help="profile file to write")
    prof.add_argument("--tp", default="1,2,4,8", help="tensor-parallel shard shapes to measure")
    prof.add_argument("--quick", action="store_true",
                      help="a few tiny sizes, for a smoke test: estimates from it do not hold for real workloads")
    prof.add_argument("--ranks", type=int, default=None,
                      help="ranks for link bandwidth (default: every GPU; 0 or 1 skips it)")
    prof.add_argument("--cuda-graphs", action="store_true", help="time decode steps as replayed CUDA graphs")
    prof.add_argument("--eager-layers", action="store_true",
                      help="time tp=1 layers uncompiled, for runs whose models set compile: false")
    prof.add_argument("--transposed-weights", action="store_true",
                      help="decode with every product's weight stored transposed, for runs that set "
                           "generation.transposed_weights")
    prof.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    prof.set_defaults(run=_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="load a tiny model across CPU ranks and check it against transformers")
    demo.add_argument("--out", default="runs/demo", help="directory for the tiny checkpoint")
    demo.add_argument("--nprocs", type=int, default=4, help="ranks to spawn (4 gives pp=2 x tp=2)")
    demo.set_defaults(run=_demo)
    add_generate_parser(sub)
    add_train_parser(sub)
    _add_plan(sub)
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
