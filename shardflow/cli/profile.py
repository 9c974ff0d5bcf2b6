"""``shardflow profile --model DIR``: measure on this hardware what the cost model needs.

For one model shape: layers, decode steps, the head and the optimizer step for each tp, and the
links between the GPUs present. The planner (``shardflow plan --profile``) and adaptive TP
(``generation.adaptive.step_times``) read the profile instead of the roofline.
"""

from __future__ import annotations

import argparse

from shardflow.profiler.measure import run_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (config.json is enough)")
    p.add_argument("--out", default="profile.json", help="profile file to write")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel shard shapes to measure")
    p.add_argument("--quick", action="store_true",
                   help="a few tiny sizes, for a smoke test: estimates from it do not hold for real workloads")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks for link bandwidth (default: every GPU; 0 or 1 skips it)")
    p.add_argument("--cuda-graphs", action="store_true", help="time decode steps as replayed CUDA graphs")
    p.add_argument("--eager-layers", action="store_true",
                   help="time tp=1 layers uncompiled, for runs whose models set compile: false")
    p.add_argument("--transposed-weights", action="store_true",
                   help="decode with every product's weight stored transposed, for runs that set "
                        "generation.transposed_weights")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")


def run(args: argparse.Namespace) -> None:
    run_profile(args.model, args.out, tps=args.tp, quick=args.quick, ranks=args.ranks, device=args.device,
                cuda_graphs=args.cuda_graphs, compile_layers=not args.eager_layers,
                transposed_weights=args.transposed_weights)
