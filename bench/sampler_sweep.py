"""The decode step's one-pass sampler kernel over its launch knobs (a diagnostic).

    python bench/sampler_sweep.py --out DIR

Per batch (1, 64, 256) and mode (greedy, sampled), us per call on 151,936-vocabulary bf16
logits (20 calls per CUDA-graph replay, ``generation.kernel_timed``): the kernel at the engine's
knobs, then over programs per SM, columns per block and warps.
Prints the best setting per case and writes ``sampler_sweep.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed  # noqa: E402

from shardflow.engine.generate import sampling_kernel as sk  # noqa: E402
from shardflow.engine.generate.sampling import pick  # noqa: E402

VOCAB = 151936


def sk_pick(candidates: torch.Tensor) -> torch.Tensor:
    return pick(candidates)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,64,256")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for batch in map(int, args.batches.split(",")):
        logits = torch.randn(batch, VOCAB, dtype=torch.bfloat16, device=device)
        seed = torch.arange(batch, device=device) * 7919
        position = torch.full((batch,), 7, device=device)
        for sample in (False, True):
            temperature = torch.full((batch,), 1.0 if sample else 0.0, device=device)

            def run(**knobs):
                return sk.candidates_triton(logits, temperature, seed, position, 0, sample, **knobs)

            want = sk_pick(run())
            base = kernel_timed(run, device) * 1e6
            rows.append(dict(batch=batch, sample=sample, knobs="engine", us=base))
            for block, warps, per_sm in itertools.product((512, 1024, 2048), (4, 8), (4, 8, 16)):
                knobs = dict(block=block, num_warps=warps, programs_per_sm=per_sm)
                us = kernel_timed(lambda: run(**knobs), device) * 1e6
                rows.append(dict(batch=batch, sample=sample, knobs=knobs, us=us,
                                 same_tokens=bool(torch.equal(sk_pick(run(**knobs)), want))))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_sweep.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    for (batch, sample), group in itertools.groupby(rows, key=lambda r: (r["batch"], r["sample"])):
        group = list(group)
        base = group[0]["us"]
        print(f"b{batch:<4} {'sampled' if sample else 'greedy':8} engine {base:7.1f} us; fastest:")
        for r in sorted(group[1:], key=lambda r: r["us"])[:4]:
            print(f"      {r['us']:7.1f} us {r['knobs']}, same tokens {r['same_tokens']}")


if __name__ == "__main__":
    main()
