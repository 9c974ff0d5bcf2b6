"""Training attention kernels on one micro-batch of the GRPO iteration's training call.

    python bench/train_attention.py --out DIR                  # GPU: both workloads
    python bench/train_attention.py --out DIR --tiny           # any machine: a tiny case

A micro-batch of prompts with several samples each (Qwen3's 16 query and 8 KV heads of 128
dimensions), its attention forward and forward + backward, per kernel: padded rows through
``scaled_dot_product_attention`` under each backend (flash, cuDNN, memory-efficient, and the
default choice), and the packed row where samples share their prompt (``models.packed_attention``:
the samples as padded rows of their prompt and tokens, and the key gather with flash attention's
variable-length kernel). Each
against its FLOPs at the matrix rate measured in the same run (4 per visible query-key pair and
head dimension forward, 2.5x that backward) and its output's error against float32.
Prints a table and writes ``train_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import WORKLOADS, measure_rates  # noqa: E402
from shared_prompts import group_batch, kernels  # noqa: E402

from shardflow.engine.shared_prompts import group_by_prompt, make_shared_micro_batches, split_rows  # noqa: E402
from shardflow.models.packed_attention import packed_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        return 0.0
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(workload: dict, budget: int, device: torch.device, dtype: torch.dtype, repeats: int,
         heads: tuple[int, int, int]) -> dict:
    h, kv, d = heads
    n = (workload["prompt_tokens"],) * 2
    r = (workload["response_tokens"],) * 2
    batch = group_batch(1000, workload["prompts"], workload["samples_per_prompt"], n, r, seed=1)
    runs = split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(), budget)
    mb = make_shared_micro_batches(batch, runs[:1], device, outputs_at="loss_mask")[0]
    seqs, tokens = mb.packed, mb.ids.shape[1]
    rows, length = len(mb.batch), int(mb.batch.lengths.max())
    g = torch.Generator(device=device).manual_seed(0)
    shared = [torch.randn(tokens, heads_, d, device=device, dtype=dtype, generator=g) for heads_ in (h, kv, kv)]
    # padded rows: each sample's own sequence (its prompt, then its tokens), taken out of the packed row
    index = torch.full((rows, length), 0, dtype=torch.long, device=device)
    offsets = mb.batch.offsets.tolist()
    for s in range(rows):
        index[s, :offsets[s + 1] - offsets[s]] = mb.token_index[offsets[s]:offsets[s + 1]]
    padded = [t[index].transpose(1, 2).contiguous() for t in shared]  # [rows, heads, length, d]
    grad_shared = torch.randn(tokens, h, d, device=device, dtype=dtype, generator=g)
    grad_padded = torch.randn(rows, h, length, d, device=device, dtype=dtype, generator=g)

    cu_q, cu_k = seqs.cu_q.tolist(), seqs.cu_k.tolist()
    pairs = sum(sum(lk - lq + j + 1 for j in range(lq))
                for lq, lk in ((cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]) for s in range(len(cu_q) - 1)))
    padded_pairs = sum(n * (n + 1) // 2 for n in mb.batch.lengths.tolist())
    reference = packed_attention(*(t.float() for t in shared), seqs)  # float32 masked attention

    def variants():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(backend):
            def run(q, k, v):
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return run

        yield "padded, default backend", "padded", sdpa(None)
        if device.type == "cuda":
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                                  ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
                yield f"padded, {name}", "padded", sdpa(backend)
        for kernel in kernels(device):
            m = make_shared_micro_batches(batch, runs[:1], device, outputs_at="loss_mask", attention=kernel)[0]
            yield f"shared, {kernel}", "shared", lambda q, k, v, m=m: packed_attention(q, k, v, m.packed)

    out = {"tokens": tokens, "rows": rows, "padded_length": length, "pairs": pairs, "padded_pairs": padded_pairs,
           "variants": {}}
    for name, layout, fn in variants():
        inputs, grad = (shared, grad_shared) if layout == "shared" else (padded, grad_padded)
        try:
            leaves = [t.detach().requires_grad_() for t in inputs]
            result = fn(*leaves)
            if layout == "shared":
                error = ((result.float() - reference).norm() / reference.norm()).item()
            else:
                want = reference[index].transpose(1, 2)
                valid = (torch.arange(length, device=device)[None] < mb.batch.lengths.to(device)[:, None])
                got = result.float().transpose(1, 2)[valid]
                error = ((got - want.transpose(1, 2)[valid]).norm() / want.transpose(1, 2)[valid].norm()).item()

            def forward():
                with torch.no_grad():
                    fn(*inputs)

            def both():
                fn(*leaves).backward(grad)

            row_pairs = pairs if layout == "shared" else padded_pairs
            out["variants"][name] = {"forward_ms": timed(forward, device, repeats),
                                     "forward_backward_ms": timed(both, device, repeats),
                                     "pairs": row_pairs, "error": error}
        except Exception as e:  # noqa: BLE001 - one kernel's failure is a result, the others go on
            out["variants"][name] = {"error_text": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workloads", default="default,long")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads = (4, 2, 16) if args.tiny else (HEADS, KV_HEADS, HEAD_DIM)
    rate = measure_rates(device)[1]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "matrix_tflops": rate / 1e12, "heads": heads, "cases": {}}
    names = ["tiny"] if args.tiny else args.workloads.split(",")
    for name in names:
        budget = 64 if args.tiny else args.micro_batch_tokens
        result["cases"][name] = case(WORKLOADS[name], budget, device, dtype, 2 if args.tiny else args.repeats, heads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_attention.json").write_text(json.dumps(result, indent=2))

    h, _, d = heads
    for name, c in result["cases"].items():
        w = WORKLOADS[name]
        print(f"\n{name}: {w['prompts']} prompts x {w['samples_per_prompt']} x ({w['prompt_tokens']} + "
              f"{w['response_tokens']}), first micro-batch: {c['rows']} rows, {c['tokens']} packed tokens; "
              f"FLOPs at {result['matrix_tflops']:.0f} TFLOP/s")
        print("| kernel | forward ms | forward + backward ms | x its FLOPs | error vs float32 |")
        print("|---|---:|---:|---:|---:|")
        for kernel, v in c["variants"].items():
            if "error_text" in v:
                print(f"| {kernel} | failed: {v['error_text'][:120]} | | | |")
                continue
            floor_ms = 1e3 * 3.5 * 4 * v["pairs"] * h * d / rate
            print(f"| {kernel} | {v['forward_ms']:.3f} | {v['forward_backward_ms']:.3f} | "
                  f"{v['forward_backward_ms'] / floor_ms:.1f}x | {v['error']:.1e} |")


if __name__ == "__main__":
    main()
