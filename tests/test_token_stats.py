"""The Triton log-prob / entropy kernels against their torch twins, run by Triton's CPU
interpreter (in a fresh process with ``TRITON_INTERPRET=1``: Triton picks the interpreter when a
kernel is defined)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


def check_kernels() -> None:
    from shardflow.models import token_stats as ts

    assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    # columns: under one block, several blocks with a ragged end; a vocabulary slice (vocab_start)
    # whose targets partly fall outside it; padding columns at -inf; bf16 as on the GPU.
    for n, v, start, dtype, scale in [(5, 37, 0, torch.float32, 1.0), (4, 2 * ts.BLOCK_V + 129, 100, torch.float32, 1.3),
                                      (3, ts.BLOCK_V + 7, 0, torch.bfloat16, 1.0)]:
        x = (4 * torch.randn(n, v, generator=g)).to(dtype)
        x[:, -3:] = float("-inf")
        x[-1] = float("-inf")  # a row whose columns here are all padding (a tp rank past the vocabulary)
        targets = torch.randint(start, start + v - 3, (n,), generator=g)
        targets[0] = targets[-1] = start + v + 5  # on another rank
        want = ts.local_stats_torch(x, targets, start, scale)
        got = ts.local_stats_triton(x, targets, start, scale)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=f"stats {n} {v} {dtype}")
        log_z, _, entropy = ts.combine(want, None)
        # the all-padding row's statistics come from the other ranks: any finite values
        log_z[-1], entropy[-1] = 5.0, 2.0
        grad_lp, grad_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
        args = (x, targets, start, scale, log_z, entropy, grad_lp, grad_h)
        atol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ts.grad_triton(*args).float(), ts.grad_torch(*args).float(), atol=atol, rtol=0,
                                   msg=f"grad {n} {v} {dtype}")


def test_triton_kernels_match_torch_in_the_interpreter():
    code = "import test_token_stats as t; t.check_kernels(); print('checked')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]


def test_vocabulary_slices_combine_to_the_full_softmax():
    """Statistics of two column slices, combined as two tp ranks would (sums over the slices), give
    the log-probabilities and entropy of the whole vocabulary."""
    from shardflow.models.token_stats import combine, local_stats_torch

    g = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(6, 20, generator=g)
    x[:, 12:] += 2.0  # the slices have different maxima
    targets = torch.randint(0, 20, (6,), generator=g)
    parts = [local_stats_torch(x[:, :9], targets, 0, 1.0), local_stats_torch(x[:, 9:], targets, 9, 1.0)]
    row_max = torch.maximum(parts[0][:, 0], parts[1][:, 0])
    rescaled = []
    for p in parts:  # what combine does before its all-reduce, by hand per rank
        alpha = torch.exp(p[:, 0] - row_max)
        rescaled.append(torch.stack([p[:, 1] * alpha, (p[:, 2] + (p[:, 0] - row_max) * p[:, 1]) * alpha, p[:, 3]]))
    total = rescaled[0] + rescaled[1]
    merged = torch.stack([row_max, total[0], total[1], total[2]], dim=-1)  # already global: combine adds nothing
    log_z, lp, h = combine(merged, None)
    logp = torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(lp, logp.gather(-1, targets[:, None])[:, 0].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(h, -(logp.exp() * logp).sum(-1).float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(log_z, torch.logsumexp(x, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("keep_chunks", [1, 3])
def test_kept_chunk_logits_give_the_recomputed_gradients(keep_chunks, monkeypatch):
    """Chunks of logits kept from forward (the leading ones, as many as ``keep_bytes`` holds) give
    backward exactly the gradients that computing them again gives; without grad nothing is kept."""
    from shardflow.models import token_stats as ts

    kept: list[int] = []  # chunks each forward kept
    forward = ts._HeadStats.forward

    def counting(ctx, *args):
        out = forward(ctx, *args)
        kept.append(len(ctx.kept))
        return out

    monkeypatch.setattr(ts._HeadStats, "forward", staticmethod(counting))
    g = torch.Generator().manual_seed(3)
    n, vocab, hidden_size = 6, 50, 8
    hidden = torch.randn(n, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g)
    targets = torch.randint(0, 45, (n,), generator=g)
    assert ts.chunk_width(n, vocab, 12 * n) == 12  # chunks of 12 columns: 5 of them, the last ragged
    results = []
    for keep_bytes in (0, keep_chunks * n * 12 * 4):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = ts.head_logprobs_and_entropy(h, w, targets, 0, 45, None, temperature=0.7,
                                               chunk_elements=12 * n, keep_bytes=keep_bytes)
        (lp * torch.arange(n) + 0.3 * ent).sum().backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    assert kept == [0, keep_chunks]
    for recomputed, from_kept in zip(*results):
        assert torch.equal(recomputed, from_kept)
    with torch.no_grad():  # no backward: nothing to keep, whatever the room
        ts.head_logprobs_and_entropy(hidden, weight.requires_grad_(), targets, 0, 45, None,
                                     chunk_elements=12 * n, keep_bytes=1 << 30)
    assert kept[-1] == 0


def specialisation(kernel, args: tuple) -> tuple:
    """What Triton compiles a variant by, for each argument (as near as a CPU test can say): a
    tensor's dtype, an int's divisibility by 16 and being 1 (or, where the kernel does not
    specialise on it, its width), a float's type."""
    loose = set(getattr(kernel, "do_not_specialize", ()))
    out = []
    for name, a in zip(kernel.arg_names, args):
        if hasattr(a, "dtype"):
            out.append(("pointer", a.dtype))
        elif isinstance(a, bool) or not isinstance(a, int):
            out.append((type(a).__name__,))
        elif name in loose:
            out.append(("int", -2**31 <= a < 2**31))
        else:
            out.append(("int", a % 16 == 0, a == 1))
    return tuple(out)


class Recorder:
    """A kernel's stand-in: records the specialisation of each launch and each warm-up, runs nothing."""

    def __init__(self, kernel):
        self.kernel, self.launched, self.warmed = kernel, set(), set()

    def __getitem__(self, grid):
        return lambda *args, **options: self.launched.add((specialisation(self.kernel, args), tuple(options.items())))

    def warmup(self, *args, grid, **options):
        from triton.runtime.jit import MockTensor

        args = tuple(MockTensor.wrap_dtype(a) for a in args)
        self.warmed.add((specialisation(self.kernel, args), tuple(options.items())))


@pytest.mark.parametrize("vocab", [600, 512])
def test_warmed_kernels_are_the_variants_training_launches(vocab, monkeypatch):
    """``warm_kernels`` compiles the statistics and gradient kernels with the specialisations that
    the head's forward and backward launch over the same chunks: chunks of 256 columns, the last
    one ragged (88 columns: not a multiple of 16) or not."""
    from shardflow.models import token_stats as ts

    stats, grad = Recorder(ts._stats_kernel), Recorder(ts._grad_kernel)
    monkeypatch.setattr(ts, "_stats_kernel", stats)
    monkeypatch.setattr(ts, "_grad_kernel", grad)
    monkeypatch.setattr(ts, "_fused", lambda x: True)  # the kernels' path, on CPU tensors
    rows, elements = 4, 4 * 256
    hidden = torch.randn(rows, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, dtype=torch.float32, requires_grad=True)
    lp, ent = ts.head_logprobs_and_entropy(hidden, weight, torch.zeros(rows, dtype=torch.long), 32, vocab, None,
                                           chunk_elements=elements, keep_bytes=0)
    (lp.sum() + ent.sum()).backward()
    assert ts.warm_kernels(torch.float32, vocab, 32, rows=rows, chunk_elements=elements) == -(-vocab // 256)
    assert len(stats.launched) == (2 if vocab % 16 else 1)
    assert stats.warmed == stats.launched and grad.warmed == grad.launched
