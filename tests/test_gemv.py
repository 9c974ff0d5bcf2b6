"""The one-row product kernel against F.linear, run by Triton's CPU interpreter (in a fresh
process with ``TRITON_INTERPRET=1``, since Triton picks the interpreter when a kernel is defined),
and ``linear``'s choice of path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardflow.models import gemv

pytest.importorskip("triton")


def check_kernel() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    # (N, K): rows and columns that fill whole blocks, and ones that leave partial blocks
    for (n, k), dtype, bias, lead in [((16, 1024), torch.float32, False, (1,)), ((13, 700), torch.float32, True, (1, 1)),
                                      ((40, 520), torch.bfloat16, False, (1, 1)), ((9, 64), torch.bfloat16, True, ())]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(*lead, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        got = gemv.gemv_triton(x, w, b)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (*lead, n) and got.dtype == dtype
        # fp32: only the summation order differs; bf16: the output is rounded to bf16 once (the
        # interpreter truncates, so one bf16 step: 2**-7 relative).
        atol = 1e-4 if dtype == torch.float32 else 1e-3 * float(want.abs().max())
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=0 if dtype == torch.float32 else 2**-7,
                                   msg=f"{n} {k} {dtype} {bias} {lead}")
    # a weight row stride larger than K (a slice of a wider matrix)
    wide = torch.randn(10, 300, generator=g)
    x = torch.randn(1, 200, generator=g)
    torch.testing.assert_close(gemv.gemv_triton(x, wide[:, :200]), F.linear(x, wide[:, :200]), atol=1e-4, rtol=0)
    # several knobs give the same result
    w, x = torch.randn(24, 300, generator=g), torch.randn(1, 300, generator=g)
    for block_n, block_k in ((1, 16), (4, 128), (32, 512)):
        torch.testing.assert_close(gemv.gemv_triton(x, w, block_n=block_n, block_k=block_k), F.linear(x, w),
                                   atol=1e-4, rtol=0)


def check_op() -> None:
    """The registered op: its fake agrees with the kernel, and a compiled graph calls it."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(1, 1, 96, generator=g), torch.randn(20, 96, generator=g), torch.randn(20, generator=g)
    torch.library.opcheck(gemv.gemv_op, (x, w, b))
    torch.library.opcheck(gemv.gemv_op, (x[0], w, None))
    compiled = torch.compile(lambda x, w: gemv.gemv_op(x, w, None).relu(), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), F.linear(x, w).relu(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("check", ["check_kernel", "check_op"])
def test_kernel_matches_linear_in_the_interpreter(check):
    code = f"import test_gemv as t; t.{check}(); print('checked')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]


def test_bad_shapes_are_refused_before_launch():
    w = torch.randn(8, 32)
    for x, weight in ((torch.randn(2, 32), w), (torch.randn(1, 31), w), (torch.randn(1, 32), w.t().contiguous().t())):
        with pytest.raises(ValueError, match="gemv takes one row"):
            gemv.gemv_triton(x, weight)


def test_linear_takes_the_kernel_only_for_one_row_on_a_gpu_without_autograd(monkeypatch):
    x1, x2, w = torch.randn(1, 1, 32), torch.randn(2, 1, 32), torch.randn(8, 32)
    with torch.no_grad():
        assert not gemv.use_gemv(x1, w)  # CPU tensors: F.linear
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert gemv.use_gemv(x1, w)
        assert not gemv.use_gemv(x2, w)  # two rows
        assert not gemv.use_gemv(x1.double(), w.double())  # a dtype the kernel does not take
        assert not gemv.use_gemv(x1, w.t().contiguous().t())  # weight not contiguous in K
    assert not gemv.use_gemv(x1, w)  # autograd on: training keeps F.linear
