"""The one-pass Triton sampler against the torch reference (``local_candidates`` + ``pick``), run by
Triton's CPU interpreter (in a fresh process with ``TRITON_INTERPRET=1``: Triton picks the
interpreter when a kernel is defined); and the CPU ``sample`` unchanged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from background import Background, selected

from shardflow.engine.generate.sampling import (
    GREEDY,
    SAMPLE,
    SamplingTensors,
    gumbel_noise,
    local_candidates,
    noise_bits,
    pick,
    sample,
    scaled_logits,
    uniform_noise,
    unit_interval,
)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from shardflow.engine.generate import sampling_kernel as sk  # noqa: E402

BLOCK = 64  # small blocks, so that a few hundred columns make several blocks and chunks


@triton.jit
def _hash_kernel(Seed, Position, Ids, Bits, Noise, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = sk._row_key(tl.load(Seed + row), tl.load(Position + row))
    offs = tl.arange(0, BLOCK)
    bits = sk._noise_bits(key, tl.load(Ids + offs, mask=offs < V, other=0))
    tl.store(Bits + row * V + offs, bits.to(tl.int64), mask=offs < V)
    tl.store(Noise + row * V + offs, sk._gumbel(bits, False), mask=offs < V)


@triton.jit
def _gumbel_kernel(Bits, Noise, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(Bits + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(Noise + offs, sk._gumbel(bits, FAST), mask=offs < n)


def rows(temperature, seed0=0, position=7) -> SamplingTensors:
    n = len(temperature)
    return SamplingTensors(temperature=torch.tensor(temperature), top_k=torch.zeros(n, dtype=torch.long),
                           top_p=torch.ones(n), seed=torch.arange(seed0, seed0 + n) * 7919,
                           position=torch.arange(n) * 1000 + position)


def kernel(logits, st, vocab_start, mode):
    return sk.candidates_triton(logits, st.temperature, st.seed, st.position, vocab_start, mode == SAMPLE,
                                block=BLOCK)


def check_hash() -> None:
    """The kernel's uint32 hash equals ``noise_bits`` bit for bit; its Gumbel noise is the torch one
    up to the last bits of float32 logs (numpy's here, the reference's torch)."""
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**32, 2**62 - 1, 2**62 - 2**31]),
                       torch.randint(0, 2**62, (26,), generator=g)])
    positions = torch.cat([torch.tensor([0, 2**31 - 1, 2**31, 2**31 + 5, 2**32 - 1, 2**32 + 3]),
                           torch.randint(0, 2**33, (26,), generator=g)])
    ids = torch.cat([torch.tensor([0, 1, 151_935, 262_143, 2**31 - 1, 2**32 - 1, 0x61C88647, 0x61C88646]),
                     torch.randint(0, 2**18, (300,), generator=g)])
    bits = torch.empty(len(seeds), len(ids), dtype=torch.int64)
    noise = torch.empty(len(seeds), len(ids))
    _hash_kernel[(len(seeds),)](seeds, positions, ids, bits, noise, len(ids), BLOCK=512)
    assert torch.equal(bits, noise_bits(seeds, positions, ids))
    assert torch.equal(unit_interval(bits), uniform_noise(seeds, positions, ids))
    torch.testing.assert_close(noise, gumbel_noise(seeds, positions, ids), atol=1e-6, rtol=1e-6)


def compare(logits, st, vocab_start, mode) -> torch.Tensor:
    """Each chunk's fields equal ``local_candidates`` of its columns; the picks are equal. Returns
    the tokens."""
    chunks, chunk = sk.num_chunks(*logits.shape, logits.device, block=BLOCK)
    z = scaled_logits(logits, st.temperature)
    wants = [local_candidates(z[:, c * chunk:(c + 1) * chunk], st, vocab_start + c * chunk, mode)
             for c in range(chunks)]
    want_tokens, want_lp = pick(local_candidates(z, st, vocab_start, mode)[None])
    got = kernel(logits, st, vocab_start, mode)  # [C, B, 5]
    assert got.shape == (chunks, logits.shape[0], 5) and got.dtype == torch.float64
    for c, want in enumerate(wants):
        assert not got[c].isnan().any()
        # index, z of the best, max: exact; best score: the Gumbel noise's float32 logs (numpy's
        # here) may differ from torch's in the last bit; the sum: another summation order.
        assert torch.equal(got[c, :, 1:4], want[:, 1:4]), (c, got[c], want)
        torch.testing.assert_close(got[c, :, 0], want[:, 0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got[c, :, 4], want[:, 4], atol=0, rtol=1e-6)
    tokens, lp = pick(got)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
    return tokens


def check_mixed_rows() -> None:
    """Greedy and sampled rows in one batch, temperatures other than 1, a vocabulary slice
    (vocab_start > 0) whose size is no multiple of the block, padding at -inf filling whole
    chunks, bf16 and fp32 logits, several blocks per chunk."""
    g = torch.Generator().manual_seed(1)
    st = rows([0.0, 0.7, 1.0, 1.3, 0.0, 2.5])
    for dtype, vocab_start in ((torch.bfloat16, 0), (torch.float32, 3000)):
        logits = (3 * torch.randn(6, 700, generator=g)).to(dtype)
        logits[:, 500:] = float("-inf")  # 6 chunks of 2 blocks: the last two are padding only
        assert sk.num_chunks(6, 700, logits.device, block=BLOCK) == (6, 2 * BLOCK)
        for mode in (GREEDY, SAMPLE):
            tokens = compare(logits, st, vocab_start, mode)
            assert (tokens < vocab_start + 500).all()
        sampled = tokens[[1, 2, 3, 5]]
        greedy = compare(logits, rows([0.0] * 6), vocab_start, GREEDY)
        assert torch.equal(tokens[[0, 4]], greedy[[0, 4]]) and not torch.equal(sampled, greedy[[1, 2, 3, 5]])
    # a strided view (every other row of a larger tensor), as a compiled graph may lay logits out
    logits = (3 * torch.randn(8, 300, generator=g))[::2]
    compare(logits, rows([1.0, 0.0, 0.5, 1.0]), 17, SAMPLE)


def check_batch_one_and_ties() -> None:
    """Batch 1 spreads over many chunks; equal logits resolve to the lowest index, within a lane,
    across lanes and across chunks (greedy, as torch.argmax)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 2000, generator=g)
    assert sk.num_chunks(1, 2000, logits.device, block=BLOCK)[0] == 32  # 8 programs x 4 "SMs"
    for mode in (GREEDY, SAMPLE):
        compare(logits, rows([0.9]), 0, mode)
    ties = torch.randn(5, 600, generator=g).clamp(max=2.0).to(torch.bfloat16)
    ties[0] = 0.0  # all equal: the first column
    ties[1, [500, 70 + BLOCK, 70, 130]] = 4.0  # the same lane in two blocks, and other lanes
    ties[2, [599, 333]] = 4.0  # two chunks
    ties[3, 2 * BLOCK:] = 4.0  # from a chunk's first column on
    ties[4, :] = float("-inf")  # padding only: the first column, max -inf, sum 0
    st = rows([0.0] * 5)
    got = kernel(ties, st, 40, GREEDY)
    tokens, _ = pick(got[:, :4])
    assert tokens.tolist() == [40, 40 + 70, 40 + 333, 40 + 2 * BLOCK]
    assert got[:, 4, 1].tolist() == [40 + c * sk.num_chunks(5, 600, ties.device, block=BLOCK)[1]
                                     for c in range(got.shape[0])]
    assert (got[:, 4, [0, 2, 3]] == float("-inf")).all() and (got[:, 4, 4] == 0).all()
    compare(ties[:4], rows([0.0] * 4), 40, GREEDY)


def check_vocab_parallel() -> None:
    """tp slices' partials, concatenated in rank order, pick the full vocabulary's token, including
    a last rank holding padding only for its tail (as the engine pads the vocabulary)."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 900, 4
    logits = 2 * torch.randn(n, vocab, generator=g)
    st = rows([0.8, 0.0, 1.0, 1.2], seed0=11)
    full = pick(local_candidates(scaled_logits(logits, st.temperature), st, 0, SAMPLE)[None])
    for tp in (2, 3):
        local = -(-vocab // tp) + 20
        padded = torch.full((n, local * tp), float("-inf"))
        padded[:, :vocab] = logits
        parts = [kernel(padded[:, r * local:(r + 1) * local], st, r * local, SAMPLE) for r in range(tp)]
        tokens, lp = pick(torch.cat(parts, dim=0))
        assert torch.equal(tokens, full[0]), tp
        torch.testing.assert_close(lp, full[1], atol=1e-6, rtol=0)


def check_op() -> None:
    """The registered op: its fake agrees with the kernel (opcheck, symbolic sizes included) and a
    compiled graph calls it without breaking, at two batch sizes."""
    g = torch.Generator().manual_seed(4)
    st = rows([1.0, 0.0, 0.6])
    logits = torch.randn(3, 1100, generator=g).to(torch.bfloat16)
    args = (logits, st.temperature, st.seed, st.position, 5, True)
    torch.library.opcheck(sk.sample_candidates_op, args)

    def draw(x, t, seed, position):
        return pick(sk.sample_candidates_op(x, t, seed, position, 5, True))

    compiled = torch.compile(draw, backend="aot_eager", fullgraph=True, dynamic=True)
    for b in (3, 2):
        got, want = compiled(*args[:4]), draw(*args[:4])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), b
        args = tuple(a[:2] for a in args[:4]) + args[4:]


@pytest.fixture(scope="module")
def interpreted(request) -> Background:
    """The selected checks, each in a fresh process in Triton's interpreter, side by side."""
    # One torch thread: on a 2-core machine with torch 2.13, the first multi-threaded float32 logs
    # of a fresh process were seen off by 1e-4 (relative) in about one process of twenty, with or
    # without Triton, which made the torch reference and not the kernel wrong.
    bg = Background()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    for item in selected(request, "test_kernel_matches_torch_in_the_interpreter"):
        check = item.callspec.params["check"]
        code = f"import torch; torch.set_num_threads(1); import test_sampling_kernel as t; t.{check}(); print('checked')"
        bg.start(check, [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, timeout=300)
    yield bg
    bg.close()


@pytest.mark.parametrize("check", ["check_hash", "check_mixed_rows", "check_batch_one_and_ties",
                                   "check_vocab_parallel", "check_op"])
def test_kernel_matches_torch_in_the_interpreter(check, interpreted):
    done = interpreted.result(check)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]


def test_chunks_cover_the_vocabulary_with_whole_blocks():
    cpu = torch.device("cpu")
    for batch, vocab in [(1, 151_936), (64, 151_936), (256, 151_936), (3, 100), (1000, 5000)]:
        chunks, chunk = sk.num_chunks(batch, vocab, cpu)
        assert chunk % sk.BLOCK_V == 0 and (chunks - 1) * chunk < vocab <= chunks * chunk, (batch, vocab)
    assert sk.num_chunks(1, 151_936, cpu) == (30, 5 * sk.BLOCK_V)  # about 32 programs on 4 "SMs"
    assert sk.num_chunks(256, 151_936, cpu)[0] == 1


def test_cpu_sample_draws_what_it_always_drew():
    """The torch path stays the CPU path and the reference: these rows draw what the sampler drew
    before the kernel existed."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    st = SamplingTensors(temperature=torch.tensor([0.0, 0.5, 1.0, 1.0, 1.7, 0.0]),
                         top_k=torch.zeros(6, dtype=torch.long), top_p=torch.ones(6),
                         seed=torch.tensor([0, 1, 99, 2**62 - 1, 2**40 + 3, 5]),
                         position=torch.tensor([3, 3, 2**31 + 1, 70_000, 0, 12]))
    expected = {GREEDY: ([30, 34, 30, 9, 20, 7], [-2.13043, -1.18947, -2.07414, -1.85324, -2.58812, -2.01817]),
                SAMPLE: ([30, 5, 17, 9, 36, 7], [-2.13043, -5.65788, -4.84793, -1.85324, -4.04986, -2.01817])}
    for mode, (tokens, logprobs) in expected.items():
        got, lp = sample(logits, st, vocab_start=0, vocab_size=50, group=None, mode=mode)
        assert got.tolist() == tokens, mode
        torch.testing.assert_close(lp, torch.tensor(logprobs), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="the hardware's approximate log runs on NVIDIA GPUs")
def test_gpu_noise_is_the_torch_noise_and_picks_its_tokens():
    """On an NVIDIA GPU the noise's outer log is the hardware's approximation: finite and within 1e-6
    (and float32's last bits) of torch's noise for every uniform, those next to 1 (the largest noise)
    included; the kernel then picks the torch path's tokens on a Qwen3-sized vocabulary."""
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    top = torch.arange(2**23 - 4096, 2**23)  # u next to 1, where -log(u) is smallest
    bits = (torch.cat([torch.arange(4096), top, torch.randint(0, 2**23, (1 << 20,), generator=g)]) << 9).to(cuda)
    noise = torch.empty(len(bits), device=cuda)
    _gumbel_kernel[(triton.cdiv(len(bits), 1024),)](bits, noise, len(bits), FAST=True, BLOCK=1024)
    want = -torch.log(-torch.log(unit_interval(bits)))
    assert noise.isfinite().all()
    torch.testing.assert_close(noise, want, atol=1e-6, rtol=3e-7)  # the last bits of float32 up to 16.6
    st = rows([1.0] * 60 + [0.7, 1.3, 0.0, 2.0])
    st = SamplingTensors(**{name: t.to(cuda) for name, t in vars(st).items()})
    logits = (3 * torch.randn(64, 151_936, generator=g)).to(torch.bfloat16).to(cuda)
    got = sk.candidates_triton(logits, st.temperature, st.seed, st.position, 0, True)
    want_tokens, _ = pick(local_candidates(scaled_logits(logits, st.temperature), st, 0, SAMPLE)[None])
    assert torch.equal(pick(got)[0], want_tokens)
