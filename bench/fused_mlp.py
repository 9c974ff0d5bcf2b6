"""The training MLP (SwiGLU) with its activation fused into the products, against the compiled one.

    python bench/fused_mlp.py --out DIR            # GPU with quack-kernels (CuTe DSL) importable
    python bench/fused_mlp.py --out DIR --tiny     # any machine: the reference path only

One micro-batch of each GRPO workload's training call (Qwen3-0.6B at 32768 tokens, Qwen3-1.7B at
16384), the MLP's forward and forward + backward:

- ``compiled``: what training runs today, gate and up as two products, SwiGLU between them and
  the down product, through ``torch.compile`` (inductor's elementwise kernels, cuBLAS products);
- ``quack``: quack's ``mlp_func`` (the quack-kernels package: gate/up as one product whose
  epilogue applies SwiGLU, backward's down product whose epilogue applies its derivative; gate
  and up concatenated per call), eager and through ``torch.compile``, and with its autotuned tiles.
  An experiment: training does not use it.

Each against its products' FLOPs at the matrix rate measured in the same run (6 N H I forward,
twice that backward), and its output and gradients against float32. Prints a table and writes
``fused_mlp.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import SHAPES, measure_rates  # noqa: E402
from train_attention import timed  # noqa: E402


CASES = {"qwen3-0.6b": 32768, "qwen3-1.7b": 16384}  # the training call's micro-batch tokens


def swiglu_mlp(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def quack_mlp(tuned: bool):
    def run(x, w_gate, w_up, w_down):
        from quack.mlp import mlp_func  # optional: only where quack-kernels is installed

        # concat_layout: the first product's weight is [gate; up], not interleaved rows
        return mlp_func(x, torch.cat((w_gate, w_up)), w_down, activation="swiglu", tuned=tuned, concat_layout=True)
    return run


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(name: str, mlp, tokens: int, hidden: int, inter: int, device, dtype, repeats: int,
            flops_per_s: float) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    weights = [(torch.randn(o, i, device=device, dtype=dtype, generator=g) * i ** -0.5).requires_grad_()
               for o, i in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x.requires_grad_()
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    leaves = [x, *weights]

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_out = swiglu_mlp(*ref_leaves)
    ref_out.backward(grad.float())

    started = time.perf_counter()
    out = mlp(*leaves)
    out.backward(grad)
    first_s = time.perf_counter() - started
    errors = {"out": relative_error(out, ref_out),
              **{f"grad_{n}": relative_error(t.grad, r.grad)
                 for n, t, r in zip(("x", "gate", "up", "down"), leaves, ref_leaves)}}
    # another micro-batch size (each has its own): what compiling or tuning again costs
    other = x[:tokens - 24].detach().requires_grad_()
    started = time.perf_counter()
    mlp(other, *weights).backward(grad[:tokens - 24])
    new_size_s = time.perf_counter() - started

    def forward():
        with torch.no_grad():
            mlp(*leaves)

    def forward_backward():
        for t in leaves:
            t.grad = None
        mlp(*leaves).backward(grad)

    fwd_ms, step_ms = timed(forward, device, repeats), timed(forward_backward, device, repeats)
    floor_ms = 18 * tokens * hidden * inter / flops_per_s * 1e3
    return dict(case=name, first_call_s=first_s, new_size_call_s=new_size_s, forward_ms=fwd_ms, forward_backward_ms=step_ms,
                floor_ms=floor_ms, errors=errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, the compiled path only (any machine)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-tuned", action="store_true", help="leave out quack's autotuned tiles")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth, flops_per_s = measure_rates(device)
    shapes = {"tiny": (64, 64, 96)} if args.tiny else {
        name: (tokens, SHAPES[name]["hidden_size"], SHAPES[name]["intermediate_size"])
        for name, tokens in CASES.items()}
    candidates = {"compiled": torch.compile(swiglu_mlp)}
    if device.type == "cuda" and not args.tiny:
        candidates.update({"quack": quack_mlp(False), "quack, compiled": torch.compile(quack_mlp(False))})
        if not args.skip_tuned:
            candidates["quack-tuned"] = quack_mlp(True)

    rows = []
    for shape, (tokens, hidden, inter) in shapes.items():
        for name, mlp in candidates.items():
            try:
                row = measure(name, mlp, tokens, hidden, inter, device, dtype, args.repeats, flops_per_s)
            except Exception as error:  # a candidate that does not run here is reported, not fatal
                row = dict(case=name, error=f"{type(error).__name__}: {error}"[:500])
            rows.append(dict(shape=shape, tokens=tokens, hidden=hidden, intermediate=inter, **row))

    print("| shape, tokens | case | forward ms | forward + backward ms (x its products' floor) | "
          "first call s (another size) | largest relative error |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']}, {r['tokens']} | {r['case']} | failed: {r['error'][:120]} | | | |")
            continue
        print(f"| {r['shape']}, {r['tokens']} | {r['case']} | {r['forward_ms']:.2f} | "
              f"{r['forward_backward_ms']:.2f} ({r['forward_backward_ms'] / r['floor_ms']:.2f}x) | "
              f"{r['first_call_s']:.1f} ({r['new_size_call_s']:.1f}) | {max(r['errors'].values()):.2e} |")
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, copy_bytes_per_s=bandwidth, matrix_flops_per_s=flops_per_s,
                  rows=rows)
    (args.out / "fused_mlp.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
