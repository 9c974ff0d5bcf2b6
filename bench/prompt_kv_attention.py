"""Would decode attention that reads a GRPO group's prompt KV once pay? The engine's kernel against
a two-kernel cascade on the GRPO iteration's shape, each alone, per CUDA-graph replay.

    python bench/prompt_kv_attention.py --out runs/bench-prompt-kv            # GPU: Qwen3-1.7B shape
    TRITON_INTERPRET=1 python bench/prompt_kv_attention.py --out DIR --tiny   # CPU: checks it runs

The samples of a prompt hold identical copies of the prompt's keys and values (one prefill, copied
into every sample's slot), and the engine's kernel reads every row's copy. The cascade: a prefix
kernel per (prompt, KV head) reads the prompt's positions once from one slot and computes the
online-softmax state (max, sum, unnormalised output) of all its samples' query heads at once; the
row kernel (the engine's, starting from that state) then reads only each row's own positions. KV
bytes fall by the prompt's share of each context, and so do the row kernel's iterations.

Prints, per context (all rows at the same length, as with forced lengths), us per call of each
and the output difference, and the mean over the contexts (the decode steps of the iteration go
through them evenly); writes ``prompt_kv_attention.json`` to ``--out``. A measurement of a
candidate design, not a path the engine runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import kernel_timed, measure_bandwidth  # noqa: E402

from shardflow.engine.decode_attention import (BLOCK_N, NUM_STAGES, NUM_WARPS, attend_positions,  # noqa: E402
                                              decode_attention_triton)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _prefix_kernel(Q, K, V, GroupRows, GroupSlot, PrefixLen, Acc, Max, Sum,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                   stride_ab, stride_ah, stride_mb, scale_log2,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One (prompt, KV head): its ROWS samples x GROUP query heads over the prompt's positions."""
    g = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(GroupSlot + g).to(tl.int64)
    plen = tl.load(PrefixLen + g).to(tl.int32)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = offs_q < ROWS * GROUP
    mask_d = offs_d < HEAD_DIM
    rows = tl.load(GroupRows + g * ROWS + offs_q // GROUP, mask=mask_q, other=0).to(tl.int64)
    heads = kvh * GROUP + offs_q % GROUP
    q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_q[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + slot * stride_ks + kvh * stride_kh
    v_base = V + slot * stride_vs + kvh * stride_vh
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    m_i, l_i, acc = attend_positions(q, k_base, v_base, stride_kt, stride_vt, 0, plen, m_i, l_i, acc, scale_log2,
                                     HEAD_DIM, BLOCK_D, BLOCK, PRECISION, UPCAST)
    mask = mask_q[:, None] & mask_d[None, :]
    tl.store(Acc + rows[:, None] * stride_ab + heads[:, None] * stride_ah + offs_d[None, :], acc, mask=mask)
    tl.store(Max + rows * stride_mb + heads, m_i, mask=mask_q)
    tl.store(Sum + rows * stride_mb + heads, l_i, mask=mask_q)


@triton.jit
def _rows_kernel(Q, K, V, Slots, Lengths, PrefixLen, Acc, Max, Sum, Out,
                 stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                 stride_ab, stride_ah, stride_mb, stride_ob, stride_oh, scale_log2,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The engine's one-split kernel, starting at the row's first own position from the prefix's state."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(Slots + b).to(tl.int64)
    length = tl.load(Lengths + b).to(tl.int32)
    lo = tl.load(PrefixLen + b).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    mask = mask_h[:, None] & mask_d[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.load(Max + b * stride_mb + heads, mask=mask_h, other=float("-inf"))
    l_i = tl.load(Sum + b * stride_mb + heads, mask=mask_h, other=0.0)
    acc = tl.load(Acc + b * stride_ab + heads[:, None] * stride_ah + offs_d[None, :], mask=mask, other=0.0)
    k_base = K + slot * stride_ks + kvh * stride_kh
    v_base = V + slot * stride_vs + kvh * stride_vh
    m_i, l_i, acc = attend_positions(q, k_base, v_base, stride_kt, stride_vt, lo, length, m_i, l_i, acc, scale_log2,
                                     HEAD_DIM, BLOCK_D, BLOCK, PRECISION, UPCAST)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask)


def cascade(q, k, v, slots, lengths, group_rows, group_slot, prefix_len, row_prefix, state):
    """Decode attention of every row, the prompts' positions read once per prompt."""
    B, H, d = q.shape
    K = k.shape[1]
    G, rows = group_rows.shape
    acc, row_max, row_sum = state
    scale = (1.0 / math.sqrt(d)) * math.log2(math.e)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = q.device.type != "cuda"
    block_d = max(16, triton.next_power_of_2(d))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
               acc.stride(0), acc.stride(1), row_max.stride(0))
    _prefix_kernel[(G, K)](q, k, v, group_rows, group_slot, prefix_len, acc, row_max, row_sum, *strides, scale,
                           GROUP=H // K, ROWS=rows, HEAD_DIM=d, BLOCK_Q=max(16, triton.next_power_of_2(rows * H // K)),
                           BLOCK_D=block_d, BLOCK=BLOCK_N, PRECISION=precision, UPCAST=upcast,
                           num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    out = torch.empty_like(q)
    _rows_kernel[(B, K)](q, k, v, slots, lengths, row_prefix, acc, row_max, row_sum, out, *strides,
                         out.stride(0), out.stride(1), scale, GROUP=H // K, HEAD_DIM=d,
                         BLOCK_H=max(16, triton.next_power_of_2(H // K)), BLOCK_D=block_d, BLOCK=BLOCK_N,
                         PRECISION=precision, UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def measure(device, dtype, prompts: int, samples: int, heads: int, kv_heads: int, d: int, prompt: int,
            max_len: int, contexts: list[int]) -> list[dict]:
    batch = prompts * samples
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch + 1, kv_heads, max_len, d, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    for p in range(prompts):  # every sample of a prompt holds the same copy of its prompt's KV
        rows = slice(p * samples, (p + 1) * samples)
        k[rows, :, :prompt] = k[p * samples, :, :prompt]
        v[rows, :, :prompt] = v[p * samples, :, :prompt]
    q = torch.randn(batch, heads, d, device=device, dtype=dtype, generator=g)
    slots = torch.arange(batch, device=device)
    group_rows = slots.view(prompts, samples).to(torch.int32)
    group_slot = group_rows[:, 0].contiguous()
    prefix_len = torch.full((prompts,), prompt, device=device, dtype=torch.int32)
    row_prefix = torch.full((batch,), prompt, device=device, dtype=torch.int32)
    state = (torch.empty(batch, heads, d, device=device, dtype=torch.float32),
             torch.empty(batch, heads, device=device, dtype=torch.float32),
             torch.empty(batch, heads, device=device, dtype=torch.float32))
    results = []
    for context in contexts:
        lengths = torch.full((batch,), context, device=device, dtype=torch.int32)
        args = (q, k, v, slots, lengths)
        engine_out = decode_attention_triton(*args, None)
        cascade_out = cascade(*args, group_rows, group_slot, prefix_len, row_prefix, state)
        item = k.element_size()
        results.append({
            "context": context,
            "engine_us": 1e6 * kernel_timed(lambda: decode_attention_triton(*args, None), device),
            "cascade_us": 1e6 * kernel_timed(lambda: cascade(*args, group_rows, group_slot, prefix_len, row_prefix,
                                                                     state), device),
            "engine_bytes": 2 * batch * kv_heads * context * d * item,
            "cascade_bytes": 2 * kv_heads * d * item * (prompts * prompt + batch * (context - prompt)),
            "max_abs_diff": (engine_out.float() - cascade_out.float()).abs().max().item(),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--contexts", default="96,192,320,448,575")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:  # 2 prompts x 4 samples, 2 KV heads of 16, prompts of 8 positions
        shape = dict(prompts=2, samples=4, heads=4, kv_heads=2, d=16, prompt=8, max_len=40)
        contexts = [12, 39]
    else:  # the GRPO iteration's: 32 prompts x 8 samples, Qwen3-1.7B's heads, 64-token prompts
        shape = dict(prompts=32, samples=8, heads=16, kv_heads=8, d=128, prompt=64, max_len=576)
        contexts = [int(c) for c in args.contexts.split(",")]
    rows = measure(device, dtype, **shape, contexts=contexts)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "shape": shape, "rows": rows}
    if device.type == "cuda":
        result["bandwidth_gb_s"] = measure_bandwidth(device, 4) / 1e9
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_kv_attention.json").write_text(json.dumps(result, indent=2))

    print(f"| context | engine us | cascade us | engine GB/s | cascade GB/s | max abs diff |  ({shape['prompts']} prompts "
          f"x {shape['samples']} samples, {shape['prompt']}-position prompts, {dtype})")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['engine_us']:.1f} | {r['cascade_us']:.1f} | {r['engine_bytes'] / r['engine_us'] / 1e3:.0f}"
              f" | {r['cascade_bytes'] / r['cascade_us'] / 1e3:.0f} | {r['max_abs_diff']:.1e} |")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(f"mean over the contexts: engine {mean('engine_us'):.1f} us, cascade {mean('cascade_us'):.1f} us "
          f"({mean('cascade_us') / mean('engine_us'):.3f}x)"
          + (f"; copy bandwidth {result['bandwidth_gb_s']:.0f} GB/s" if "bandwidth_gb_s" in result else ""))


if __name__ == "__main__":
    main()
