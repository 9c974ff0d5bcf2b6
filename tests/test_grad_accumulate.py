"""The grouped gradient add against one plain add per gradient: the kernel run by Triton's CPU
interpreter (in a fresh process with ``TRITON_INTERPRET=1``: Triton picks the interpreter when a
kernel is defined) and compiled for sm_90; the CPU path as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardflow.engine.train import grad_accumulate as ga

BLOCK = 64  # small blocks, so that a few hundred elements make several programs per source


def reference(flat: torch.Tensor, offsets, grads) -> torch.Tensor:
    """``flat`` with each gradient added to its slice, upcast first. A float32 + bf16 / fp16 /
    float32 sum is one float32 rounding either way, so every path must match it exactly."""
    want = flat.clone()
    for a, g in zip(offsets, grads):
        want[a:a + g.numel()] += g.flatten().float()
    return want


def case(seed: int = 0):
    """A flat buffer and 12 gradients over slices with gaps between them, in shuffled order:
    sizes of one element, none, exactly one block, a block and one, several blocks with a ragged
    end; bf16, fp16 and float32; one non-contiguous (a transposed view)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1,), (0,), (BLOCK,), (BLOCK + 1,), (8, 25), (3, 7), (2 * BLOCK - 1,), (1, 1), (5, 60), (0, 4),
              (4, 2 * BLOCK + 3), (2, 50)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    grads = [torch.randn(s, generator=g).to(dtypes[i % 3]) for i, s in enumerate(shapes)]
    grads[4] = grads[4].T  # [25, 8], strided
    offsets, at = [], 3
    for t in grads:
        offsets.append(at)
        at += t.numel() + 5  # 5 elements between slices that nothing may touch
    order = torch.randperm(len(grads), generator=g).tolist()
    flat = torch.randn(at + 7, generator=g)
    return flat, [offsets[i] for i in order], [grads[i] for i in order]


def check_kernel() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    launches = []
    kernel = ga._accumulate_kernel

    class Counting:  # records each launch's grid
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    ga._accumulate_kernel = Counting()
    flat, offsets, grads = case()
    want = reference(flat, offsets, grads)
    ga.accumulate_triton(flat, offsets, grads, block=BLOCK)
    assert torch.equal(flat, want)
    # 9 contiguous non-empty sources (the empty ones and the transposed one launch nothing): 8 + 1
    sizes = [t.numel() for t in grads if t.is_contiguous() and t.numel()]
    assert len(sizes) == 9
    assert launches == [(sum(-(-n // BLOCK) for n in sizes[:8]),), (-(-sizes[8] // BLOCK),)]
    # a second micro-batch adds onto the first; a one-source group; a group with nothing to add
    ga.accumulate_triton(flat, offsets, grads, block=BLOCK)
    assert torch.equal(flat, reference(want, offsets, grads))
    ga.accumulate_triton(flat, offsets[:1], grads[:1], block=BLOCK)
    ga.accumulate_triton(flat, [0], [torch.empty(0)], block=BLOCK)
    assert torch.equal(flat, reference(reference(want, offsets, grads), offsets[:1], grads[:1]))
    # the default block: a source of a block and one
    flat = torch.zeros(ga.BLOCK + 9)
    grad = torch.randn(ga.BLOCK + 1).bfloat16()
    ga.accumulate_triton(flat, [8], [grad])
    assert torch.equal(flat, reference(torch.zeros(ga.BLOCK + 9), [8], [grad]))


def test_kernel_matches_plain_adds_in_the_interpreter():
    pytest.importorskip("triton")
    code = "import test_grad_accumulate as t; t.check_kernel(); print('checked')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]


def test_cpu_path_adds_each_gradient():
    flat, offsets, grads = case(seed=1)
    want = reference(flat, offsets, grads)
    ga.accumulate_into(flat, offsets, grads)
    assert torch.equal(flat, want)


def test_kernel_compiles_for_hopper():
    """The interpreter runs the kernel's Python, not its compilation: compile it for sm_90
    (Triton's own ptxas, no GPU needed) with mixed source dtypes and offsets past 2**31."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = ga._accumulate_kernel
    dtypes = ["bf16", "fp32", "fp16", "bf16", "bf16", "fp32", "fp32", "fp32"]
    types = {n: "*fp32" if n == "Flat" else f"*{dtypes[int(n[3:])]}" if n.startswith("Src") else "constexpr"
             if n in ("ALIGNED", "BLOCK") else "i64" if n.startswith("dst") else "i32" for n in fn.arg_names}
    for aligned in (False, True):
        constants = {(fn.arg_names.index("ALIGNED"),): aligned, (fn.arg_names.index("BLOCK"),): ga.BLOCK}
        source = ASTSource(fn=fn, signature=types, constexprs=constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": ga.NUM_WARPS})


def test_a_short_group_is_the_variant_of_a_full_one_and_warmed(monkeypatch):
    """The step's last group (fewer than MAX_SOURCES gradients) launches the variant a full group
    does (its unused slots repeat a source: the same pointer dtypes), and ``warm_kernels`` compiles
    that variant; a buffer past 2**31 elements also the one of 64-bit offsets."""
    pytest.importorskip("triton")
    from test_token_stats import Recorder

    recorder = Recorder(ga._accumulate_kernel)
    monkeypatch.setattr(ga, "_accumulate_kernel", recorder)
    grads = [torch.zeros(n, dtype=torch.bfloat16) for n in (5000, 12, 4096, 8, 300, 2048, 7, 1, 9000, 64, 3)]
    offsets = [4 * i * 10000 for i in range(len(grads))]
    ga.accumulate_triton(torch.zeros(4 * 10000 * len(grads)), offsets, grads)
    assert len(recorder.launched) == 1  # 8 sources, then 3
    ga.warm_kernels(torch.bfloat16, 10 ** 9)
    assert recorder.warmed == recorder.launched
    ga.warm_kernels(torch.bfloat16, 3 * 10 ** 9)
    assert len(recorder.warmed) == 2
