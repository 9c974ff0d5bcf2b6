"""The decode step's greedy and sampled candidates in one pass over the logits.

``sampling.local_candidates`` in torch reads the [B, V] logits many times: upcast and scale, the
noise hash in int64 (each 32-bit multiply emulated with 16-bit halves), the Gumbel transform, the
maxima and the sum of exponentials; compiled, it is still several float32 and int64 passes
(0.6 ms at batch 256 on a 152K vocabulary, where one read of the bf16 logits takes 19 us). This
kernel reads each logit once and keeps everything else in registers: the scaled logit
z = logits / T (T = 1 on greedy rows), the same noise with native uint32 arithmetic (bit-identical
to ``sampling.noise_bits``), the score z + Gumbel, and the five fields of ``local_candidates``
(best score, its global index, its z, the max of z and the sum of exp(z - max)).

The grid is (rows, chunks of the row's columns): about PROGRAMS_PER_SM programs per SM at any
batch, so batch 1 still spreads over the GPU. The output [C, B, 5] holds the chunks in vocabulary
order, what ``sampling.pick`` combines; ties go to the lowest index (strict comparisons inside a
chunk, the first chunk across chunks). The chunk count depends only on (B, V) and the GPU, so a
CUDA graph captured for a batch size stays valid; the op is registered so that a compiled decode
step treats it as one call. Tested on CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from shardflow.models.triton_warmup import warmup

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

BLOCK_V = 1024  # columns per inner step
PROGRAMS_PER_SM, NUM_WARPS = 8, 4


def num_chunks(batch, vocab, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM, block: int = BLOCK_V):
    """(chunks per row, columns per chunk): whole blocks per chunk, about ``programs_per_sm``
    programs per SM in all. Plain integer arithmetic, so that it also runs on the symbolic sizes
    of the fake implementation under torch.compile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    blocks = -(-vocab // block)
    want = -(-(programs_per_sm * sms) // torch.sym_max(batch, 1))
    per_chunk = -(-blocks // torch.sym_min(want, blocks))
    return -(-blocks // per_chunk), per_chunk * block


if triton is not None:

    @triton.jit
    def _mix32(x):
        """``sampling._mix32`` on uint32: the multiplies wrap mod 2**32 natively."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _row_key(seed, position):
        """``sampling.row_keys`` of one row: int64 seed and position -> uint32 key."""
        k = _mix32((seed >> 32).to(tl.uint32))
        k = _mix32(k ^ seed.to(tl.uint32))  # int64 -> uint32 keeps the low 32 bits
        return _mix32(k ^ position.to(tl.uint32))

    @triton.jit
    def _noise_bits(key, vocab_ids):
        """``sampling.noise_bits``: uint32 hash of a row key and global vocabulary ids."""
        v = _mix32(vocab_ids.to(tl.uint32) + 0x9E3779B9)  # (id - 0x61C88647) mod 2**32 there
        h = _mix32(key ^ v)
        return _mix32(h ^ (key >> 7))

    @triton.jit
    def _gumbel(bits, FAST: tl.constexpr):
        """-log(-log(u)), u = ``sampling.unit_interval(bits)`` (exact: 23 bits and a half in float32).
        tl.log is the log that inductor's code for ``torch.log`` calls. FAST (on the GPU): the outer
        log through the hardware's approximate log2, one instruction where the precise log takes
        about forty (the two logs were most of the sampled kernel's arithmetic), within about 2e-7 of
        it. The inner log stays precise: near u = 1 its result is tiny, and the approximation's
        absolute error (about 2**-22) could make -log(u) zero or negative there, the noise infinite."""
        e = -tl.log(((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07)  # 2**-23
        if FAST:
            return -0.6931471805599453 * tl.extra.cuda.libdevice.fast_log2f(e)  # ln x = ln 2 * log2 x
        return -tl.log(e)

    @triton.jit
    def _candidates_kernel(X, Temperature, Seed, Position, Out, stride_x, stride_oc, V, vocab_start, chunk,
                           SAMPLE: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(Temperature + row).to(tl.float32)
        sampled = t > 0
        t = tl.where(sampled, t, 1.0)
        if SAMPLE:
            key = _row_key(tl.load(Seed + row).to(tl.int64), tl.load(Position + row).to(tl.int64))
            gate = sampled.to(tl.float32)  # noise only on sampled rows, as in local_candidates
        offs = tl.arange(0, BLOCK)
        lo = c * chunk
        base = X + row.to(tl.int64) * stride_x
        # Per lane: best score, its column and z (strict >: the earlier column keeps a tie); the
        # max of z and the sum of exp(z - max), both from -inf / 0 so an all-padding chunk stays so.
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = lo + offs
        best_z = tl.full([BLOCK], float("-inf"), tl.float32)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for v0 in range(lo, tl.minimum(lo + chunk, V), BLOCK):
            cols = v0 + offs
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            if t != 1.0:  # x / 1 = x exactly: greedy rows and T = 1 skip the division
                z = tl.math.div_rn(z, t)  # correctly rounded, as torch's division (Triton's "/" is not)
            score = z
            if SAMPLE:
                score = z + _gumbel(_noise_bits(key, vocab_start + cols), FAST_LOG) * gate
            take = score > best
            best = tl.where(take, score, best)
            best_col = tl.where(take, cols, best_col)
            best_z = tl.where(take, z, best_z)
            # One exp per element: exp(lower - higher) of (running max, z) scales whichever is lower.
            # (Triton's fast exp, as in token_stats: the sum needs ~1e-7, not the last bit.)
            hi = tl.maximum(m, z)
            d = tl.exp(tl.minimum(m, z) - tl.where(hi == float("-inf"), 0.0, hi))
            s = tl.where(z > m, s * d + 1.0, s + d)
            m = hi
        top = tl.max(best, 0)
        col = tl.min(tl.where(best == top, best_col, 2147483647), 0)  # lowest column of the best
        z_top = tl.max(tl.where(best_col == col, best_z, float("-inf")), 0)  # the one lane holding it
        row_max = tl.max(m, 0)
        s_row = tl.sum(s * tl.exp(m - tl.where(row_max == float("-inf"), 0.0, row_max)), 0)
        out = Out + c * stride_oc + row * 5
        tl.store(out + 0, top.to(tl.float64))
        tl.store(out + 1, (vocab_start + col).to(tl.float64))
        tl.store(out + 2, z_top.to(tl.float64))
        tl.store(out + 3, row_max.to(tl.float64))
        tl.store(out + 4, s_row.to(tl.float64))


def candidates_triton(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                      vocab_start: int, sample: bool, *, block: int = BLOCK_V, programs_per_sm: int = PROGRAMS_PER_SM,
                      num_warps: int = NUM_WARPS) -> torch.Tensor:
    """[C, B, 5] float64 candidates of the C vocabulary chunks of raw logits [B, V_local] (bf16 or
    fp32, padding at -inf): ``local_candidates(scaled_logits(logits, temperature), ...)`` per chunk,
    with noise iff ``sample`` (SAMPLE mode). GPU, or ``TRITON_INTERPRET=1`` on CPU. The keyword
    options are the kernel's tuning knobs."""
    if triton is None:
        raise RuntimeError("the Triton sampler needs the triton package")
    return _run(lambda kernel, grid: kernel[grid], logits.device, logits, temperature, seed, position, vocab_start,
                sample, block=block, programs_per_sm=programs_per_sm, num_warps=num_warps)


def warm_kernels(device: torch.device, dtype: torch.dtype, *, batch: int, vocab: int, vocab_start: int,
                 sample: bool) -> None:
    """Compile, without launching, the kernel that ``candidates_triton`` launches on ``device``
    for ``batch`` rows of ``vocab`` local logits in ``dtype`` (``_run``'s arguments computed from
    tensors on the meta device: the step's dtypes, shapes and strides, no memory)."""
    meta = torch.device("meta")
    rows = torch.empty(batch, dtype=torch.int64, device=meta)
    _run(warmup, device,
         torch.empty(batch, vocab, dtype=dtype, device=meta), torch.empty(batch, dtype=torch.float32, device=meta),
         rows, rows, vocab_start, sample)


def _run(launch, device: torch.device, logits, temperature, seed, position, vocab_start: int, sample: bool, *,
         block: int = BLOCK_V, programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The kernel's launch: ``launch(kernel, grid)`` -> a callable taking its arguments
    (``kernel[grid]``, or a warm-up); ``device`` is the one it runs on."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = logits.shape
    chunks, chunk = num_chunks(B, V, device, programs_per_sm, block)
    out = torch.empty(chunks, B, 5, dtype=torch.float64, device=logits.device)
    launch(_candidates_kernel, (B, chunks))(
        logits, temperature.contiguous(), seed.contiguous(), position.contiguous(), out,
        logits.stride(0), out.stride(0), V, vocab_start, chunk, SAMPLE=sample, BLOCK=block,
        FAST_LOG=device.type == "cuda" and torch.version.hip is None,  # NVIDIA's libdevice; not the interpreter
        num_warps=num_warps,
    )
    return out


# A registered operator, so that torch.compile treats the kernel as one opaque call.
@torch.library.custom_op("shardflow::sample_candidates", mutates_args=())
def sample_candidates_op(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                         vocab_start: int, sample: bool) -> torch.Tensor:
    return candidates_triton(logits, temperature, seed, position, vocab_start, sample)


@sample_candidates_op.register_fake
def _(logits, temperature, seed, position, vocab_start, sample):
    chunks, _ = num_chunks(logits.shape[0], logits.shape[1], logits.device)
    return logits.new_empty(chunks, logits.shape[0], 5, dtype=torch.float64)
