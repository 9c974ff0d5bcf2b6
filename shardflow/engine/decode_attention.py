"""Attention of one new token per request over its slot of the KV cache.

The contract (``ATTENTION``): the new token's q [B,H,d], k and v [B,K,d] as projected, with the
layer's ``QKPrep`` (q/k norms and rotary); the function norms and rotates q and k, writes k and v
into each row's slot at position ``lengths - 1``, and attends over positions ``[0, lengths)``.

- ``decode_torch``: the model's own ops, ``write_kv`` and ``decode_attention_torch`` (gathers each
  row's slot and masks past its length); runs anywhere, and is the reference.
- ``decode_attention_triton``: one split-K Triton kernel for the GPU. Each program takes one
  (request, KV head, split) and reads only that request's cached positions, through its slot
  index, for all the query heads sharing the KV head (GQA). Every program norms and rotates its q
  rows and the new key itself (a few hundred values), the first split writes the new key and value
  into the cache, the last one adds the new token from registers, and the last program of a
  (request, KV head) to finish merges the splits with their log-sum-exp (with one split, the
  program writes the output itself). That leaves one kernel per layer where there were three or
  four (rotary and cache write, attention, merge). The split count depends only on the batch size,
  so a CUDA graph captured for a batch size stays valid while lengths grow; each split's range is
  computed in the kernel from the request's current length. Tested on CPU with ``TRITON_INTERPRET=1``.

Shapes: B requests, H local query heads, K local KV heads, S cache slots, M max length, d head dim.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from shardflow.engine.kv_cache import write_kv
from shardflow.models.transformer import QKPrep

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path needs no Triton
    triton = None

# Positions per inner step, warps, pipeline stages: one setting for all shapes, within 3% of the
# best of a sweep (bench/decode_profile.py --sweep, H200, LLaMA-3.1-8B and Qwen3-1.7B shapes,
# contexts 320-8K) at batch 1, 64 and 256, and 13% at batch 16 x 1K (see BENCHMARKS.md).
BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 4, 2
# Programs resident on an SM at these settings (two stages of a 64 x 128 K and V tile in bf16 take
# 64 KB of its 228 KB of shared memory): the splits fill one wave of them, and no more.
PROGRAMS_PER_SM = 3
MAX_SPLITS = 32


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [B,H,d]; caches [S,K,M,d]; slots, lengths [B] -> [B,H,d].

    Row b attends to positions [max(0, lengths[b] - window), lengths[b]) of slot ``slots[b]``.
    """
    k, v = k_cache[slots], v_cache[slots]  # [B,K,M,d]
    pos = torch.arange(k.shape[2], device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B,M]
    if window is not None:
        valid &= pos[None, :] >= lengths[:, None] - window
    gqa = True if q.shape[1] != k.shape[1] else False  # a bool, not a SymBool, under torch.compile
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None, :], enable_gqa=gqa)
    return out[:, :, 0]


def decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prep: QKPrep, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """The contract in plain torch: q [B,H,d], k, v [B,K,d] as projected -> [B,H,d]."""
    q, k = prep(q[:, None], k[:, None])  # [B,1,heads,d]
    write_kv(k_cache, v_cache, slots, (lengths - 1)[:, None], k, v[:, None])
    return decode_attention_torch(q[:, 0], k_cache, v_cache, slots, lengths, window)


def num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM,
               block: int = BLOCK_N) -> int:
    """Splits of each request's positions: as many as fit ``programs_per_sm`` programs per SM in
    one wave. More splits add partial results to merge and a ragged last wave; a batch that fills
    the GPU by itself (requests x KV heads >= resident programs) takes one split and no merge."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    fit = programs_per_sm * sms // max(1, batch * kv_heads)
    return max(1, min(fit, MAX_SPLITS, math.ceil(max_len / block)))


if triton is not None:

    @triton.jit
    def _norm_rotate(x, x_rot, sign, cos, sin, w, w_rot, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
                     DTYPE: tl.constexpr):
        """Rows [R, BLOCK_D] of q or k and the same rows with their halves swapped (fp32) ->
        RMSNorm-ed (times its weight) if ``NORM``, then rotated; rounded to ``DTYPE`` once at the
        end, as the compiled model's fused elementwise kernel rounds."""
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
            x = (x * r).to(DTYPE).to(tl.float32) * w
            x_rot = (x_rot * r).to(DTYPE).to(tl.float32) * w_rot
        return (x * cos + sign * x_rot * sin).to(DTYPE)

    @triton.jit
    def _merge(Acc, Max, Sum, Out, b, kvh, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob,
               stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr):
        """Combine the splits' partial results of the group's heads by their log-sum-exp, one head
        at a time over a [splits, d] tile. Loads bypass L1: other SMs wrote them."""
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < SPLITS
        mask_d = offs_d < HEAD_DIM
        for g in tl.static_range(GROUP):
            h = kvh * GROUP + g
            m_ptr = Max + b * stride_mb + h * stride_mh + offs_s
            m = tl.load(m_ptr, mask=mask_s, other=float("-inf"), cache_modifier=".cg")
            total = tl.load(Sum + b * stride_mb + h * stride_mh + offs_s, mask=mask_s, other=0.0, cache_modifier=".cg")
            acc = tl.load(Acc + b * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
                          mask=mask_s[:, None] & mask_d[None, :], other=0.0, cache_modifier=".cg")
            w = tl.exp2(m - tl.max(m, 0))  # empty splits have max -inf: weight 0
            out = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
            tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _decode_kernel(Q, KNew, VNew, Cos, Sin, QW, KW, K, V, Slots, Lengths, Acc, Max, Sum, Count, Out,
                       stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb,
                       stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                       stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
                       scale_log2, window, eps,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        length = tl.load(Lengths + b).to(tl.int32)
        new = length - 1  # the new token's position: it comes from registers, the splits cover the rest
        start = length * 0
        if window > 0:
            start = tl.maximum(length - window, 0)
        chunk = tl.cdiv(tl.cdiv(new - start, SPLITS), BLOCK) * BLOCK
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, new)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        mask_hd = mask_h[:, None] & mask_d[None, :]
        heads = kvh * GROUP + offs_h

        # q rows of this KV head's group and the new key, normed and rotated: x * cos + rotate_half(x) * sin
        half = HEAD_DIM // 2
        rot_d = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
        cos = tl.load(Cos + b * stride_cb + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(Sin + b * stride_cb + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        qw, qw_rot, kw, kw_rot = cos, cos, cos, cos  # unused without norms
        if NORM:
            qw = tl.load(QW + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
            qw_rot = tl.load(QW + rot_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
            kw = tl.load(KW + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
            kw_rot = tl.load(KW + rot_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_ptr + offs_d[None, :], mask=mask_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
        dtype = q.dtype
        q_rot = tl.load(q_ptr + rot_d[None, :], mask=mask_hd, other=0.0).to(tl.float32)
        q = _norm_rotate(q.to(tl.float32), q_rot, sign, cos, sin, qw, qw_rot, eps, HEAD_DIM, NORM, dtype)
        k_ptr = KNew + b * stride_knb + kvh * stride_knh
        k_new = tl.load(k_ptr + offs_d[None, :], mask=mask_d[None, :], other=0.0).to(tl.float32)  # [1, BLOCK_D]
        k_rot = tl.load(k_ptr + rot_d[None, :], mask=mask_d[None, :], other=0.0).to(tl.float32)
        k_new = _norm_rotate(k_new, k_rot, sign, cos, sin, kw, kw_rot, eps, HEAD_DIM, NORM, dtype)
        v_new = tl.load(VNew + b * stride_vnb + kvh * stride_vnh + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        if split == 0:  # no program of this call reads the new position from the cache
            tl.store(k_base + new * stride_kt + offs_d[None, :], k_new, mask=mask_d[None, :])
            tl.store(v_base + new * stride_vt + offs_d[None, :], v_new, mask=mask_d[None, :])
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK):
            pos = n0 + offs_n
            mask_n = pos < hi
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + pos[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, BLOCK]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if split == SPLITS - 1:  # the new token
            qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2  # [BLOCK_H]
            m_new = tl.maximum(m_i, qk)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p.to(dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m_i = m_new

        if SPLITS == 1:  # nothing to merge: the output itself
            o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_hd)
        else:
            a_ptr = Acc + b * stride_ab + heads[:, None] * stride_ah + offs_d[None, :]
            m_ptr = b * stride_mb + heads * stride_mh
            tl.store(a_ptr + split * stride_as, acc, mask=mask_hd)
            tl.store(Max + m_ptr + split, m_i, mask=mask_h)
            tl.store(Sum + m_ptr + split, l_i, mask=mask_h)
            # The last program of this (row, KV head) to finish merges. Every thread's partial
            # results are written before one thread's release (the barrier); its acquire makes the
            # other programs' visible. The merging program leaves the counter at zero.
            tl.debug_barrier()
            counter = Count + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                _merge(Acc, Max, Sum, Out, b, kvh, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob,
                       stride_oh, GROUP, HEAD_DIM, SPLITS, BLOCK_S, BLOCK_D)
                tl.atomic_xchg(counter, 0)


# Per device, zeroed counters of finished splits, one per (row, KV head). Every call leaves them at
# zero. Grown buffers never shrink or go away, since captured CUDA graphs keep their addresses.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decode attention needs {n} split counters, first asked for inside a CUDA graph "
                               "capture; run the step once before capturing it")
        held.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return held[-1]


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                            window: int | None, *, block: int = BLOCK_N, programs_per_sm: int = PROGRAMS_PER_SM,
                            num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                            splits: int | None = None) -> torch.Tensor:
    """The contract with the model's prep as tensors: q [B,H,d], k, v [B,K,d] as projected; cos, sin
    [B,d] at the new positions; the q/k RMSNorm weights [d] and epsilon (None, None, any: no norms).
    GPU, or ``TRITON_INTERPRET=1`` on CPU. The keyword options are the kernel's tuning knobs
    (benchmarks sweep them); ``splits`` overrides ``num_splits``."""
    if triton is None:
        raise RuntimeError("the Triton decode attention needs the triton package")
    # The model's q, k and v are views of one projection's output, rows apart; heads must be dense.
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    B, H, d = q.shape
    _, K, M, _ = k_cache.shape
    assert H % K == 0 and d % 2 == 0 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert k.shape == v.shape == (B, K, d) and cos.shape == sin.shape == (B, d), (q.shape, k.shape, cos.shape)
    norm = q_norm is not None
    group = H // K
    splits = splits or num_splits(B, K, M, q.device, programs_per_sm, block)
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    parts = splits if splits > 1 else 0  # one split writes ``out`` directly: no partial results
    acc = torch.empty(B, H, parts, d, dtype=torch.float32, device=q.device)
    row_max = torch.empty(B, H, parts, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(B, H, parts, dtype=torch.float32, device=q.device)
    count = _split_counters(q.device, B * K)
    # fp32 caches (tests, parity checks) take exact fp32 products, not TF32. Triton's CPU
    # interpreter cannot multiply bf16 tiles, so there they are upcast to fp32 first.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_kernel[(B, K, splits)](
        q, k, v, cos, sin, q_norm if norm else cos, k_norm if norm else cos, k_cache, v_cache, slots, lengths,
        acc, row_max, row_sum, count, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), acc.stride(0), acc.stride(1), acc.stride(2), row_max.stride(0), row_max.stride(1),
        out.stride(0), out.stride(1),
        (1.0 / math.sqrt(d)) * math.log2(math.e), window or 0, eps,
        GROUP=group, HEAD_DIM=d, SPLITS=splits, NORM=norm, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK=block, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        PRECISION=precision, UPCAST=q.device.type != "cuda",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# A registered operator, so that torch.compile treats the kernel as one opaque call that writes the caches.
@torch.library.custom_op("shardflow::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                        window: int) -> torch.Tensor:
    return decode_attention_triton(q, k, v, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, lengths,
                                   window or None)


@decode_attention_op.register_fake
def _(q, k, v, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, lengths, window):
    return q.new_empty(q.shape)  # contiguous, like the real output


def prep_tensors(prep: QKPrep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
    """(cos, sin [B,d], q norm weight, k norm weight, epsilon) of a decode step's ``prep``."""
    qn, kn = prep.q_norm, prep.k_norm
    if qn is None:
        return prep.cos[:, 0], prep.sin[:, 0], None, None, 0.0
    return prep.cos[:, 0], prep.sin[:, 0], qn.weight, kn.weight, qn.eps


def decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prep: QKPrep, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """The contract through the Triton kernel."""
    return decode_attention_op(q, k, v, *prep_tensors(prep), k_cache, v_cache, slots, lengths, window or 0)


# name -> attention function (the ``attention`` engine option)
ATTENTION = {"torch": decode_torch, "triton": decode_triton}
