"""Attention of one new token per request over its positions in the KV cache.

A row's positions lie in blocks of the cache (``kv_cache``): ``blocks`` [B, n] names each row's
blocks in order (its row of the block table), or ``blocks`` [B] its one block (a contiguous cache,
where a block is a slot). Two implementations with the same contract:

- ``decode_attention_torch``: plain torch (gathers each row's blocks and masks past its length);
  runs anywhere, and is the reference.
- ``decode_attention_triton``: a split-K Triton kernel for the GPU. Each program takes one
  (request, KV head, split) and reads only that request's valid positions, through its blocks,
  for all the query heads sharing the KV head (GQA); a second small kernel merges the splits with
  their log-sum-exp (with one split, the first kernel writes the output itself). The split count
  depends only on the batch size, so a CUDA graph captured for
  a batch size stays valid while lengths grow; each split's range is computed in the kernel from
  the request's current length. Optionally (``prompts``), the samples of one prompt read the
  prompt's positions once: a first kernel computes, per group of rows, the online-softmax state of
  all their query heads over the prompt from one row's copy, and the split kernel continues from
  it over each row's own positions. Tested on CPU with ``TRITON_INTERPRET=1``.

Shapes: B requests, H local query heads, K local KV heads, S cache blocks of N positions, n blocks
per row, d head dim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from shardflow.models.triton_warmup import warmup
from shardflow.perf.sharing import PROMPT_ROWS

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path needs no Triton
    triton = None

# Positions per inner step, warps, pipeline stages: one setting for all shapes, chosen from a
# sweep over model shapes, batches and contexts (bench/decode_profile.py --sweep; BENCHMARKS.md).
BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 4, 2
# Programs resident on an SM at these settings (two stages of a 64 x 128 K and V tile in bf16 take
# 64 KB of its 228 KB of shared memory): the splits fill one wave of them, and no more.
PROGRAMS_PER_SM = 3
MAX_SPLITS = 32


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                           lengths: torch.Tensor, window: int | None,
                           prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B,H,d]; caches [S,K,N,d]; blocks [B, n] (or [B]), lengths [B] -> [B,H,d].

    Row b attends to positions [max(0, lengths[b] - window), lengths[b]) of its blocks.
    ``prompts`` (see ``decode_attention_triton``) changes which copy of a shared prompt is read,
    not the result; this path reads every row's own.
    """
    blocks = blocks[:, None] if blocks.dim() == 1 else blocks
    B, n = blocks.shape
    _, K, N, d = k_cache.shape
    # [B,n,K,N,d] -> [B,K,n*N,d] (a view for one block per row)
    k, v = (c[blocks].transpose(1, 2).reshape(B, K, n * N, d) for c in (k_cache, v_cache))
    pos = torch.arange(k.shape[2], device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B,M]
    if window is not None:
        valid &= pos[None, :] >= lengths[:, None] - window
    gqa = True if q.shape[1] != k.shape[1] else False  # a bool, not a SymBool, under torch.compile
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None, :], enable_gqa=gqa)
    return out[:, :, 0]


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
    def attend_positions(q, k_head, v_head, block_row, stride_ks, stride_kt, stride_vs, stride_vt, block_size,
                         lo, hi, m_i, l_i, acc, scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAGED: tl.constexpr,
                         TILE_IN_BLOCK: tl.constexpr):
        """Online softmax of the query rows ``q`` [rows, BLOCK_D] over positions [lo, hi) of one
        KV head of a row whose blocks ``block_row`` names (``k_head``, ``v_head``: the head in
        block 0): the running max ``m_i``, sum ``l_i`` and unnormalised output ``acc``, updated
        BLOCK positions at a time. Not PAGED: the row is one block, whose base is computed once.
        TILE_IN_BLOCK (paged, blocks a multiple of BLOCK long): tiles start at multiples of BLOCK,
        so each lies in one block, whose number is loaded one tile ahead (the loads of a tile's
        keys then wait for no other load)."""
        offs_n = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        first = lo
        blk = tl.full([], 0, tl.int64)  # TILE_IN_BLOCK: the block of the tile to come
        if not PAGED:
            only = tl.load(block_row).to(tl.int64)
            k_head = k_head + only * stride_ks
            v_head = v_head + only * stride_vs
        if TILE_IN_BLOCK:  # an empty range stays empty: a tile of masked positions only would give NaNs
            first = tl.where(lo < hi, lo - lo % BLOCK, hi)
            blk = tl.load(block_row + first // block_size, mask=first < hi, other=0).to(tl.int64)
        for n0 in range(first, hi, BLOCK):
            pos = n0 + offs_n
            mask_n = (pos >= lo) & (pos < hi)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            if TILE_IN_BLOCK:
                at = pos % block_size
                k_rows = k_head + blk * stride_ks + at[:, None] * stride_kt
                v_rows = v_head + blk * stride_vs + at[:, None] * stride_vt
                ahead = n0 + BLOCK
                blk = tl.load(block_row + ahead // block_size, mask=ahead < hi, other=0).to(tl.int64)
            elif PAGED:  # a tile may straddle two blocks: each position's block from the row
                blk_n = tl.load(block_row + pos // block_size, mask=mask_n, other=0).to(tl.int64)
                at = pos % block_size
                k_rows = k_head + blk_n[:, None] * stride_ks + at[:, None] * stride_kt
                v_rows = v_head + blk_n[:, None] * stride_vs + at[:, None] * stride_vt
            else:
                k_rows = k_head + pos[:, None] * stride_kt
                v_rows = v_head + pos[:, None] * stride_vt
            k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [rows, BLOCK]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _prompt_kernel(Q, K, V, Blocks, Groups, Prompt, Acc, Max, Sum, batch,
                       stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                       stride_bb, block_size, stride_sb, stride_sh, stride_mb, scale_log2,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       PAGED: tl.constexpr, TILE_IN_BLOCK: tl.constexpr):
        """Program (window of ROWS rows, KV head): for each row b of the window that leads a run of
        rows of one group (see ``decode_attention_triton``), the online-softmax state of the run's
        rows x GROUP query heads over the group's shared prompt positions, read once from b's blocks.
        A program per window rather than per row: most rows lead nothing, and empty programs are
        not free (one per row costs microseconds per call)."""
        w = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_q % GROUP
        for i in range(ROWS):
            b = tl.minimum(w * ROWS + i, batch - 1)  # past the batch: the last row again, which leads nothing
            group = tl.load(Groups + b)
            prompt = tl.load(Prompt + b).to(tl.int32)
            before = tl.load(Groups + tl.maximum(b - 1, 0))
            if (prompt > 0) & ((b == 0) | (before != group)) & (w * ROWS + i < batch):
                rows = b + offs_q // GROUP
                in_run = (offs_q < ROWS * GROUP) & (rows < batch)
                in_run = in_run & (tl.load(Groups + rows, mask=in_run, other=-1) == group)
                q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                            mask=in_run[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
                if UPCAST:
                    q = q.to(tl.float32)
                m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_Q], tl.float32)
                acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
                m_i, l_i, acc = attend_positions(q, K + kvh * stride_kh, V + kvh * stride_vh,
                                                 Blocks + b.to(tl.int64) * stride_bb, stride_ks, stride_kt, stride_vs,
                                                 stride_vt, block_size, 0, prompt, m_i, l_i, acc, scale_log2,
                                                 HEAD_DIM, BLOCK_D, BLOCK, PRECISION, UPCAST, PAGED, TILE_IN_BLOCK)
                tl.store(Acc + rows[:, None] * stride_sb + heads[:, None] * stride_sh + offs_d[None, :], acc,
                         mask=in_run[:, None] & mask_d[None, :])
                tl.store(Max + rows * stride_mb + heads, m_i, mask=in_run)
                tl.store(Sum + rows * stride_mb + heads, l_i, mask=in_run)

    @triton.jit
    def _split_kernel(Q, K, V, Blocks, Lengths, Acc, Max, Sum, Out, Prompt, PromptAcc, PromptMax, PromptSum,
                      stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                      stride_bb, block_size, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob,
                      stride_oh, stride_sb, stride_sh, stride_pmb, scale_log2, window,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, SHARED: tl.constexpr, PAGED: tl.constexpr,
                      TILE_IN_BLOCK: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(Lengths + b).to(tl.int32)
        start = length * 0
        if window > 0:
            start = tl.maximum(length - window, 0)
        if SHARED:  # the prompt's positions are in the state _prompt_kernel left
            prompt = tl.load(Prompt + b).to(tl.int32)
            start = tl.maximum(start, prompt)
        chunk = tl.cdiv(tl.cdiv(length - start, SPLITS), BLOCK) * BLOCK
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, length)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_h
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        if SHARED:  # the first split starts from the prompt's state (empty for rows without one)
            has = mask_h & (offs_h * 0 + tl.where((prompt > 0) & (split == 0), 1, 0) > 0)
            m_i = tl.load(PromptMax + b * stride_pmb + heads, mask=has, other=float("-inf"))
            l_i = tl.load(PromptSum + b * stride_pmb + heads, mask=has, other=0.0)
            acc = tl.load(PromptAcc + b * stride_sb + heads[:, None] * stride_sh + offs_d[None, :],
                          mask=has[:, None] & mask_d[None, :], other=0.0)
        else:
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        block_row = Blocks + b.to(tl.int64) * stride_bb
        m_i, l_i, acc = attend_positions(q, K + kvh * stride_kh, V + kvh * stride_vh, block_row, stride_ks, stride_kt,
                                         stride_vs, stride_vt, block_size, lo, hi, m_i, l_i, acc, scale_log2, HEAD_DIM,
                                         BLOCK_D, BLOCK, PRECISION, UPCAST, PAGED, TILE_IN_BLOCK)

        if SPLITS == 1:  # nothing to merge: the output itself
            o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        else:
            a_ptr = Acc + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :]
            tl.store(a_ptr, acc, mask=mask_h[:, None] & mask_d[None, :])
            m_off = b * stride_mb + heads * stride_mh + split
            tl.store(Max + m_off, m_i, mask=mask_h)
            tl.store(Sum + m_off, l_i, mask=mask_h)

    @triton.jit
    def _merge_kernel(Acc, Max, Sum, Out, stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                      stride_ob, stride_oh,
                      HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < SPLITS
        mask_d = offs_d < HEAD_DIM
        m = tl.load(Max + b * stride_mb + h * stride_mh + offs_s, mask=mask_s, other=float("-inf"))
        s = tl.load(Sum + b * stride_mb + h * stride_mh + offs_s, mask=mask_s, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # empty splits have m = -inf: weight 0
        acc = tl.load(Acc + b * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
                      mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(s * w, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                            lengths: torch.Tensor, window: int | None,
                            prompts: tuple[torch.Tensor, torch.Tensor] | None = None, *, block: int = BLOCK_N,
                            programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS,
                            num_stages: int = NUM_STAGES, splits: int | None = None) -> torch.Tensor:
    """Same contract as ``decode_attention_torch``; GPU (or ``TRITON_INTERPRET=1`` on CPU).

    ``prompts`` = (groups, prompt) [B] int: rows whose ``prompt`` > 0 begin with that many
    positions that every row of their group holds identically (the samples of one prompt after a
    shared prefill: in the same blocks or in copies). A group's rows must be adjacent, at most ``PROMPT_ROWS`` of
    them, with the same ``prompt``; the first of them then reads those positions once for all (the
    other rows read only their own), which the result does not depend on. Ignored with a
    ``window``. The keyword options are the kernel's tuning knobs (benchmarks sweep them);
    ``splits`` overrides ``num_splits``."""
    if triton is None:
        raise RuntimeError("the Triton decode attention needs the triton package")
    return _run(lambda kernel, grid: kernel[grid], q.device, q, k_cache, v_cache, blocks, lengths, window, prompts,
                block=block, programs_per_sm=programs_per_sm, num_warps=num_warps, num_stages=num_stages,
                splits=splits)


def warm_kernels(device: torch.device, dtype: torch.dtype, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, blocks_per_row: int, windows: Sequence[int | None], shared: bool) -> None:
    """Compile, without launching, the kernels that a decode step of ``batch`` rows launches on
    ``device`` over a cache of blocks of ``block_size`` positions, ``blocks_per_row`` a row (1: a
    contiguous cache, whose block is the row's slot), for each layer's ``window`` and, where
    ``shared``, with prompt-KV sharing: ``_run`` computes the launches' arguments as for a step,
    from tensors on the meta device, which have the step's dtypes, shapes and strides (what Triton
    specialises on) and no memory."""
    meta = torch.device("meta")
    q = torch.empty(batch, heads, head_dim, dtype=dtype, device=meta)
    cache = torch.empty(1, kv_heads, block_size, head_dim, dtype=dtype, device=meta)
    blocks = torch.empty(batch, *([blocks_per_row] if blocks_per_row > 1 else []), dtype=torch.int64, device=meta)
    lengths = torch.empty(batch, dtype=torch.int64, device=meta)

    for window in dict.fromkeys(windows):
        _run(warmup, device, q, cache, cache, blocks, lengths, window, (lengths, lengths) if shared else None)


def _run(launch, device: torch.device, q, k_cache, v_cache, blocks, lengths, window, prompts, *, block: int = BLOCK_N,
         programs_per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
         splits: int | None = None) -> torch.Tensor:
    """The kernels' launches: ``launch(kernel, grid)`` -> a callable taking the kernel's
    arguments (``kernel[grid]``, or a warm-up); ``device`` is the one they run on."""
    q = q.contiguous()  # a no-op for the model's q; a compiled graph may lay it out otherwise
    B, H, d = q.shape
    _, K, N, _ = k_cache.shape
    blocks = blocks[:, None] if blocks.dim() == 1 else blocks
    assert H % K == 0 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and blocks.stride(1) == 1
    group, paged = H // K, blocks.shape[1] > 1
    tile_in_block = paged and N % block == 0
    splits = splits or num_splits(B, K, N * blocks.shape[1], device, programs_per_sm, block)
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    parts = splits if splits > 1 else 0  # one split writes ``out`` directly: no partial results
    acc = torch.empty(B, H, parts, d, dtype=torch.float32, device=q.device)
    row_max = torch.empty(B, H, parts, dtype=torch.float32, device=q.device)
    row_sum = torch.empty(B, H, parts, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    # fp32 caches (tests, parity checks) take exact fp32 products, not TF32. Triton's CPU
    # interpreter cannot multiply bf16 tiles, so there they are upcast to fp32 first.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = device.type != "cuda"
    strides_qkv = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), blocks.stride(0), N)
    scale_log2 = (1.0 / math.sqrt(d)) * math.log2(math.e)
    shared = prompts is not None and not window
    groups, prompt = prompts if shared else (lengths, lengths)  # unread without SHARED
    prompt_acc = torch.empty(B, H, d, dtype=torch.float32, device=q.device) if shared else acc
    prompt_max = torch.empty(B, H, dtype=torch.float32, device=q.device) if shared else row_max
    prompt_sum = torch.empty_like(prompt_max) if shared else row_sum
    if shared:
        launch(_prompt_kernel, (triton.cdiv(B, PROMPT_ROWS), K))(
            q, k_cache, v_cache, blocks, groups, prompt, prompt_acc, prompt_max, prompt_sum, B, *strides_qkv,
            prompt_acc.stride(0), prompt_acc.stride(1), prompt_max.stride(0), scale_log2,
            GROUP=group, HEAD_DIM=d, ROWS=PROMPT_ROWS, BLOCK_Q=max(16, triton.next_power_of_2(PROMPT_ROWS * group)),
            BLOCK_D=block_d, BLOCK=block, PRECISION=precision, UPCAST=upcast, PAGED=paged,
            TILE_IN_BLOCK=tile_in_block, num_warps=num_warps, num_stages=num_stages,
        )
    launch(_split_kernel, (B, K, splits))(
        q, k_cache, v_cache, blocks, lengths, acc, row_max, row_sum, out, prompt, prompt_acc, prompt_max, prompt_sum,
        *strides_qkv, acc.stride(0), acc.stride(1), acc.stride(2), row_max.stride(0), row_max.stride(1),
        out.stride(0), out.stride(1), prompt_acc.stride(0), prompt_acc.stride(1), prompt_max.stride(0),
        scale_log2, window or 0,
        GROUP=group, HEAD_DIM=d, SPLITS=splits, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK=block, PRECISION=precision, UPCAST=upcast, SHARED=shared, PAGED=paged,
        TILE_IN_BLOCK=tile_in_block, num_warps=num_warps, num_stages=num_stages,
    )
    if splits == 1:
        return out
    launch(_merge_kernel, (B, H))(
        acc, row_max, row_sum, out, acc.stride(0), acc.stride(1), acc.stride(2), row_max.stride(0),
        row_max.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
    )
    return out


# A registered operator, so that torch.compile treats the kernels as one opaque call.
@torch.library.custom_op("shardflow::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                        lengths: torch.Tensor, window: int, groups: torch.Tensor | None,
                        prompt: torch.Tensor | None) -> torch.Tensor:
    prompts = None if groups is None else (groups, prompt)
    return decode_attention_triton(q, k_cache, v_cache, blocks, lengths, window or None, prompts)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, blocks, lengths, window, groups, prompt):
    return q.new_empty(q.shape)  # contiguous, like the real output


def _triton_via_op(q, k_cache, v_cache, blocks, lengths, window, prompts=None):
    groups, prompt = prompts if prompts is not None else (None, None)
    return decode_attention_op(q, k_cache, v_cache, blocks, lengths, window or 0, groups, prompt)


# name -> attention function (the ``attention`` engine option)
ATTENTION = {"torch": decode_attention_torch, "triton": _triton_via_op}
