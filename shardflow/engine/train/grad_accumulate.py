"""Add a group of gradients into their slices of the flat float32 buffer in one kernel launch.

Adding each parameter's bf16 gradient into its float32 slice on its own costs one small mixed-dtype
kernel per parameter and micro-batch, about 2900 launches per training step of the 1.7B GRPO
workload (79 ms of a 2.9 s step). ``accumulate_into`` adds up to MAX_SOURCES gradients per launch:
each source is a pointer argument of its own, and the grid is the blocks of all of them in order,
so a program finds its source from the block counts before each (a static loop over the slots)
and adds one block of it into the destination in float32.

The sizes, offsets and block counts are plain scalar arguments that Triton does not specialise
on, so the changing groups of a step reuse a few compiled variants (by the sources' dtypes, offsets
past 2**31, all offsets 16-byte aligned or not). Whole blocks go unmasked, so that their loads and
stores vectorise. On CPU (or without Triton) each gradient is added on its own; tested on CPU with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardflow.models.triton_warmup import warmup

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import MockTensor  # a dtype and shape standing for a tensor: warm-ups
except ImportError:  # the plain path needs no Triton
    triton = None

MAX_SOURCES = 8  # gradients per launch: the kernel's pointer arguments
BLOCK, NUM_WARPS = 4096, 8  # elements per program


if triton is not None:

    @triton.jit
    def _slot(i: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7):
        """The i-th of eight arguments (i known at compile time)."""
        if i == 0:
            return x0
        elif i == 1:
            return x1
        elif i == 2:
            return x2
        elif i == 3:
            return x3
        elif i == 4:
            return x4
        elif i == 5:
            return x5
        elif i == 6:
            return x6
        else:
            return x7

    # Scalars vary from launch to launch: not specialised (no recompiles for ==1 or %16 values).
    @triton.jit(do_not_specialize=[f"{k}{i}" for k in ("numel", "dst", "first") for i in range(MAX_SOURCES)])
    def _accumulate_kernel(Flat, Src0, Src1, Src2, Src3, Src4, Src5, Src6, Src7,
                           numel0, numel1, numel2, numel3, numel4, numel5, numel6, numel7,
                           dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7,
                           first0, first1, first2, first3, first4, first5, first6, first7,
                           ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        for i in tl.static_range(8):  # MAX_SOURCES
            first = _slot(i, first0, first1, first2, first3, first4, first5, first6, first7)
            numel = _slot(i, numel0, numel1, numel2, numel3, numel4, numel5, numel6, numel7)
            # Block ``pid - first`` of source i, if it has one (an unused slot has numel 0).
            local = (pid - first).to(tl.int64)
            if (local >= 0) & (local * BLOCK < numel):
                src = _slot(i, Src0, Src1, Src2, Src3, Src4, Src5, Src6, Src7)
                dst = _slot(i, dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7).to(tl.int64)  # past 2**31 in big models
                if ALIGNED:
                    dst = tl.multiple_of(dst, 4)  # 16-byte float32 accesses
                out = Flat + dst + local * BLOCK + offs
                src = src + local * BLOCK + offs
                if (local + 1) * BLOCK <= numel:  # a whole block: unmasked, so the accesses vectorise
                    tl.store(out, tl.load(out) + tl.load(src).to(tl.float32))
                else:
                    mask = local * BLOCK + offs < numel
                    tl.store(out, tl.load(out, mask=mask) + tl.load(src, mask=mask).to(tl.float32), mask=mask)


def accumulate_torch(flat: torch.Tensor, offsets: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
    """``flat[offsets[i]:offsets[i] + grads[i].numel()] += grads[i]`` for each i, one add each."""
    for a, g in zip(offsets, grads, strict=True):
        flat[a:a + g.numel()].view(g.shape).add_(g)


def accumulate_triton(flat: torch.Tensor, offsets: Sequence[int], grads: Sequence[torch.Tensor], *,
                      block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """``accumulate_torch`` in one launch per MAX_SOURCES gradients (GPU, or ``TRITON_INTERPRET=1``
    on CPU). Non-contiguous gradients are added on their own. The keywords are tuning knobs."""
    if triton is None:
        raise RuntimeError("the grouped gradient add needs the triton package")
    assert flat.dim() == 1 and flat.is_contiguous() and flat.dtype == torch.float32
    group = []
    for a, g in zip(offsets, grads, strict=True):
        if not g.is_contiguous():
            flat[a:a + g.numel()].view(g.shape).add_(g)
        elif g.numel():
            group.append((a, g))
    for lo in range(0, len(group), MAX_SOURCES):
        chunk = group[lo:lo + MAX_SOURCES]
        firsts, programs = [], 0
        for _, g in chunk:
            firsts.append(programs)
            programs += triton.cdiv(g.numel(), block)
        _launch(_accumulate_kernel[(programs,)], flat, [g for _, g in chunk], [g.numel() for _, g in chunk],
                [a for a, _ in chunk], firsts, block, num_warps)


def _launch(kernel, flat, sources, numels, offsets, firsts, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """The kernel's arguments for up to MAX_SOURCES sources. Unused slots repeat the first source
    (no elements): their pointers' dtype is then the group's, so that a short group (a step's last)
    is the same compiled variant as a full one."""
    unused = MAX_SOURCES - len(sources)
    kernel(flat, *sources, *sources[:1] * unused, *numels, *[0] * unused, *offsets, *[0] * unused,
           *firsts, *[0] * unused, ALIGNED=all(a % 4 == 0 for a in offsets), BLOCK=block, num_warps=num_warps)


def warm_kernels(dtype: torch.dtype, numel: int) -> None:
    """Compile, without launching, the kernel for the current CUDA device as it adds gradients of
    ``dtype`` into a float32 buffer of ``numel`` elements: aligned offsets, and offsets past 2**31
    where the buffer reaches them (another argument type)."""
    for offset in (0, 1 << 31) if numel > 1 << 31 else (0,):
        _launch(warmup(_accumulate_kernel, (1,)), MockTensor(torch.float32),
                [MockTensor(dtype)] * MAX_SOURCES, [BLOCK] * MAX_SOURCES, [offset] * MAX_SOURCES,
                list(range(MAX_SOURCES)))


def accumulate_into(flat: torch.Tensor, offsets: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
    """Add each of ``grads`` (contiguous or not, bf16 / fp16 / fp32, any shape) into the float32
    ``flat`` [N] at its offset: the kernel on the GPU, one add per gradient elsewhere."""
    if flat.is_cuda and triton is not None:
        accumulate_triton(flat, offsets, grads)
    else:
        accumulate_torch(flat, offsets, grads)
