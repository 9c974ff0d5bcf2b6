"""Does reading the next weights into L2 during a batch-1 decode layer's small kernels pay?

    python bench/l2_prefetch.py --out runs/l2-prefetch     # one GPU (Hopper or later), LLaMA-3.1-8B shape

At batch 1 a decode step streams every weight once (the products run at ~95% of copy bandwidth),
but between the products sit latency-bound small kernels (norms, rotary, cache write, attention
at short contexts) during which HBM idles. This experiment runs 32 LLaMA-3.1-8B-shaped layers at
batch 1 in one CUDA graph, with the small parts compiled as the engine compiles them, and on a
second stream reads the weights of the product that comes next (all of o during rotary and
attention; the first megabytes of gate/up, down and the next layer's q/k/v during the norms and
SiLU) with an L2-keeping load, so that the product finds them in L2. Reported: ms per 32 layers
with and without, against the weights' bytes / copy bandwidth; outputs must be identical (the
reads change nothing). Writes ``l2_prefetch.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed, measure_bandwidth  # noqa: E402

from shardflow.engine.decode_attention import decode_attention_triton  # noqa: E402

H, Q, KV, I, D = 4096, 4096, 1024, 14336, 128  # LLaMA-3.1-8B
LAYERS = 32
MB = 2**20


@triton.jit
def _touch(ptr, n, sink, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Load ``n`` int32 words into L2 (kept there over streaming data); the xor of what one
    program read goes to ``sink`` only when it is 0x7FFFFFFF, a store the compiler cannot drop."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    x = tl.reduce(acc, 0, _xor)
    tl.store(sink + pid, x, mask=x == 0x7FFFFFFF)


@triton.jit
def _xor(a, b):
    return a ^ b


class Prefetcher:
    """Reads on a side stream, each after the work queued so far on the main stream; ``join``
    makes the main stream wait for them (needed before a CUDA-graph capture ends)."""

    def __init__(self, programs: int, device: torch.device):
        self.programs, self.stream = programs, torch.cuda.Stream(device)
        self.sink = torch.zeros(programs, dtype=torch.int32, device=device)

    def __call__(self, weight: torch.Tensor, nbytes: int) -> None:
        words = weight.view(-1).view(torch.int32)[: nbytes // 4]
        block = 2048
        iters = math.ceil(words.numel() / (block * self.programs))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            _touch[(self.programs,)](words, words.numel(), self.sink, BLOCK=block, ITERS=iters, num_warps=4)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def rotary(t, cos, sin):  # t [B, heads, D]
    a, b = t[..., : D // 2], t[..., D // 2:]
    return t * cos + torch.cat((-b, a), -1) * sin


def silu_mul(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def build(device, context: int):
    layers = []
    for _ in range(LAYERS):
        layer = dict(qkv=torch.randn(Q + 2 * KV, H), o=torch.randn(H, Q), gu=torch.randn(2 * I, H),
                     down=torch.randn(H, I), n1=torch.ones(H), n2=torch.ones(H),
                     k=torch.randn(2, KV // D, context + 1, D), v=torch.randn(2, KV // D, context + 1, D))
        layers.append({name: (t * 0.02).to(device, torch.bfloat16) for name, t in layer.items()})
    return layers


def step(x, layers, cos, sin, slots, pos, prefetch, norm, rot, act, ahead):
    """32 layers at batch 1; ``prefetch`` (or None) reads ahead: all of o, ``ahead`` bytes of
    gate/up, down and the next layer's q/k/v."""
    for i, w in enumerate(layers):
        qkv = F.linear(norm(x, w["n1"]), w["qkv"])
        if prefetch:
            prefetch(w["o"], w["o"].numel() * 2)
        q, k, v = qkv.split((Q, KV, KV), -1)
        q, k = rot(q.view(1, Q // D, D), cos, sin), rot(k.view(1, KV // D, D), cos, sin)
        w["k"][slots, :, pos] = k
        w["v"][slots, :, pos] = v.view(1, KV // D, D)
        a = decode_attention_triton(q, w["k"], w["v"], slots, pos + 1, None)
        x = x + F.linear(a.view(1, Q), w["o"])
        if prefetch:
            prefetch(w["gu"], ahead)
        gu = F.linear(norm(x, w["n2"]), w["gu"])
        if prefetch:
            prefetch(w["down"], ahead)
        x = x + F.linear(act(gu), w["down"])
        if prefetch and i + 1 < len(layers):
            prefetch(layers[i + 1]["qkv"], ahead)
    if prefetch:
        prefetch.join()
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--programs", default="32,66,132", help="programs of the prefetch kernel")
    parser.add_argument("--ahead-mb", default="4,8,16", help="megabytes read ahead of gate/up, down and q/k/v")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("l2_prefetch measures a GPU's L2; it needs CUDA")
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth(device, 4.0)
    norm, rot, act = (torch.compile(f, dynamic=False) for f in (rmsnorm, rotary, silu_mul))
    weight_bytes = LAYERS * 2 * (H * (Q + 2 * KV) + H * Q + 2 * I * H + H * I)
    report = dict(device=torch.cuda.get_device_name(), bandwidth_gb_s=bandwidth / 1e9, rows=[])
    for context in (int(c) for c in args.contexts.split(",")):
        layers = build(device, context)
        kv_bytes = LAYERS * 2 * (KV // D) * context * D * 2
        roofline = (weight_bytes + kv_bytes) / bandwidth
        x = torch.randn(1, H, device=device, dtype=torch.bfloat16)
        slots = torch.tensor([1], device=device)
        pos = torch.tensor([context - 1], device=device)
        angle = torch.rand(1, 1, D, device=device)
        cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
        variants = [("none", None, 0)] + [(f"p{p}_ahead{a}", p, a) for p in map(int, args.programs.split(","))
                                          for a in map(int, args.ahead_mb.split(","))]
        reference = None
        for name, programs, ahead in variants:
            prefetch = Prefetcher(programs, device) if programs else None
            fn = lambda: step(x, layers, cos, sin, slots, pos, prefetch, norm, rot, act, ahead * MB)  # noqa: E731
            got = fn()
            reference = got if reference is None else reference
            seconds = kernel_timed(fn, device, calls=2, repeat=7)
            row = dict(context=context, variant=name, programs=programs, ahead_mb=ahead, ms=seconds * 1e3,
                       roofline_ms=roofline * 1e3, vs_roofline=seconds / roofline, same_output=bool(torch.equal(got, reference)))
            report["rows"].append(row)
            print(f"ctx {context:>5} {name:>16}: {row['ms']:6.3f} ms for {LAYERS} layers "
                  f"({row['vs_roofline']:.2f}x the {row['roofline_ms']:.3f} ms roofline), same output {row['same_output']}")
            (out / "l2_prefetch.json").write_text(json.dumps(report, indent=2))
        del layers


if __name__ == "__main__":
    main()
