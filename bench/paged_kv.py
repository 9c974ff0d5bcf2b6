"""The paged KV cache against the contiguous one: decode speed, and the batch a cache holds.

    python bench/paged_kv.py --out runs/bench           # one GPU: LLaMA-3.1-8B shape, bf16
    python bench/paged_kv.py --out runs/bench --tiny    # any machine: a tiny shape (CPU check)

In one run, on one device:
1. the decode attention kernel alone at batch x context (default 64 x 1024): contiguous slots
   against the same positions in shuffled blocks (each block size), microseconds per call;
2. the engine on random weights, greedy, forced length, the same batch and context: ms per decode
   step with the contiguous cache and with the paged one (each block size); CUDA graphs on,
   torch.compile off unless --compile (the comparison is the cache's, not the compiler's);
3. capacity: for a cache of --cache-gib of the shape's KV (bf16), requests whose lengths follow a
   long-tailed distribution (log-normal, mean --mean-len, capped at --max-len): how many are
   held at once at their final lengths by slots of --max-len each against blocks (the engine's
   own allocator, on the meta device: no memory is touched).
Prints a table and writes ``paged_kv.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import (  # noqa: E402
    LLAMA_8B,
    TINY,
    bench_engine,
    kernel_timed,
    llama_config,
    measure_bandwidth,
    random_model,  # noqa: E402
)

from shardflow.engine.generate.decode_attention import ATTENTION  # noqa: E402
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.kv_cache import KVCache, bytes_per_position  # noqa: E402
from shardflow.engine.generate.requests import SamplingParams, make_requests  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402


def bench_attention(cfg, device, batch: int, context: int, blocks: list[int]) -> list[dict]:
    attention = ATTENTION["triton" if device.type == "cuda" else "torch"]
    K, d = cfg.num_kv_heads, cfg.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k = torch.randn(batch + 1, K, context, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, cfg.num_heads, d, device=device, dtype=dtype)
    lengths = torch.full((batch,), context, device=device)
    slots = torch.arange(batch, device=device)
    want = attention(q, k, v, slots, lengths, None)
    rows = [dict(layout="contiguous", us=kernel_timed(lambda: attention(q, k, v, slots, lengths, None), device) * 1e6)]
    for block in blocks:
        n = math.ceil(context / block)
        order = torch.randperm(batch * n, device=device)
        table = order.view(batch, n)
        kp = torch.zeros(batch * n, K, block, d, device=device, dtype=dtype)
        vp = torch.zeros_like(kp)
        pad = n * block - context
        for pool, src in ((kp, k), (vp, v)):
            whole = torch.nn.functional.pad(src[:batch], (0, 0, 0, pad))  # [B,K,n*block,d]
            pool[table.reshape(-1)] = whole.view(batch, K, n, block, d).transpose(1, 2).reshape(-1, K, block, d)
        got = attention(q, kp, vp, table, lengths, None)
        diff = (got.float() - want.float()).abs().max().item()
        us = kernel_timed(lambda: attention(q, kp, vp, table, lengths, None), device) * 1e6
        rows.append(dict(layout=f"paged {block}", us=us, max_abs_diff=diff))
        del kp, vp
    for row in rows:
        row["vs_contiguous"] = row["us"] / rows[0]["us"]
    return rows


def bench_decode(cfg, device, dtype, batch: int, context: int, steps: int, blocks: list[int], compile_: bool,
                 bandwidth: float) -> list[dict]:
    """Per cache layout: all rows at one context (``bench_engine``: they cross into new blocks at
    the same step), and staggered by up to 63 positions (rows get new blocks at most steps)."""
    model = random_model(cfg, device, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    rows = []
    for block in [None, *blocks]:
        engine = GenerationEngine(model, EngineConfig(max_seq_len=context + steps + 2, max_batch_size=batch,
                                                      kv_cache_bytes=1 << 30, compile=compile_,
                                                      kv_block_size=block))
        row = bench_engine(engine, cfg, batch, context, steps, bandwidth, item)
        row["layout"] = "contiguous" if block is None else f"paged {block}"
        row["staggered_ms_per_step"] = staggered_step(engine, cfg, batch, context, steps) * 1e3
        row["preemptions"] = engine.stats.preemptions
        rows.append(row)
        engine.release_cache()
        del engine
    for row in rows:
        row["vs_contiguous"] = row["ms_per_step"] / rows[0]["ms_per_step"]
        row["staggered_vs_contiguous"] = row["staggered_ms_per_step"] / rows[0]["staggered_ms_per_step"]
    del model
    return rows


def staggered_step(engine: GenerationEngine, cfg, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step of ``batch`` requests of context - (0..63) positions."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (context - (i * 37) % 64,), generator=g).tolist()
               for i in range(batch)]
    requests = make_requests(prompts, SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.stats.decode_steps.clear()
    engine.generate(requests)
    times = [t for b, t in engine.stats.decode_steps if b == batch]
    assert len(times) == steps, engine.stats.decode_steps
    return statistics.median(times[3:])


def bench_capacity(cfg, cache_gib: float, mean_len: int, max_len: int, blocks: list[int], seed: int = 0) -> dict:
    """Requests held at once at their final lengths, in the same bytes, by slots and by blocks."""
    shard = shard_for(cfg, Layout((0,)), 0)
    budget = int(cache_gib * 2**30)
    g = torch.Generator().manual_seed(seed)
    sigma = 1.0  # log-normal: mean = exp(mu + sigma^2 / 2)
    mu = math.log(mean_len) - sigma**2 / 2
    lengths = torch.exp(mu + sigma * torch.randn(100_000, generator=g)).clamp(1, max_len).long().tolist()
    per_position = bytes_per_position(shard, cfg, torch.bfloat16)
    common = dict(budget_bytes=budget, max_len=max_len, max_slots=len(lengths), dtype=torch.bfloat16, device="meta")
    out = dict(cache_gib=cache_gib, mean_len=sum(lengths) / len(lengths), max_len=max_len,
               kv_bytes_per_token=per_position, slots=KVCache.for_model(cfg, shard, **common).num_slots)
    for block in blocks:
        cache = KVCache.for_model(cfg, shard, block_size=block, **{**common, "max_slots": 4096})
        held = 0
        for n in lengths:
            if cache.num_free == 0:
                break
            [slot] = cache.allocate(1)
            if not cache.ensure([slot], [n]):
                break
            held += 1
        out[f"paged {block}"] = held
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for paged_kv.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (for CPU)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed")
    parser.add_argument("--blocks", default="16,64", help="comma-separated block sizes")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--cache-gib", type=float, default=40.0)
    parser.add_argument("--mean-len", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=16384)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    shape = TINY if tiny else LLAMA_8B
    batch, context = args.batch or (4 if tiny else 64), args.context or (64 if tiny else 1024)
    steps = args.steps or (8 if tiny else 32)
    blocks = [int(b) for b in args.blocks.split(",")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = llama_config(shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__, shape=shape, batch=batch, context=context, steps=steps,
                        compile=args.compile)
    t0 = time.perf_counter()

    def save() -> None:
        report["seconds"] = time.perf_counter() - t0
        (out / "paged_kv.json").write_text(json.dumps(report, indent=2))

    report["capacity"] = capacity = bench_capacity(llama_config(LLAMA_8B), args.cache_gib, args.mean_len,
                                                   args.max_len, blocks)
    print(f"capacity of {args.cache_gib:g} GiB of LLaMA-3.1-8B KV at lengths of mean {capacity['mean_len']:.0f}, "
          f"max {args.max_len}: {capacity['slots']} slots; "
          + ", ".join(f"{b}: {capacity[b]}" for b in capacity if b.startswith("paged")))
    save()
    bandwidth = measure_bandwidth(device, 0.25 if tiny else 4.0)
    report["bandwidth_gb_per_s"] = bandwidth / 1e9
    report["attention"] = bench_attention(cfg, device, batch, context, blocks)
    for row in report["attention"]:
        print(f"attention {row['layout']:>12}: {row['us']:8.1f} us ({row['vs_contiguous']:.3f}x)"
              + (f", max diff {row['max_abs_diff']:.2g}" if "max_abs_diff" in row else ""))
    save()
    report["decode"] = bench_decode(cfg, device, dtype, batch, context, steps, blocks, args.compile, bandwidth)
    for row in report["decode"]:
        print(f"decode {row['layout']:>12}: batch {batch} context {context}: {row['ms_per_step']:7.2f} ms/step "
              f"({row['vs_contiguous']:.3f}x), roofline {row['roofline_ms']:.2f} ms ({row['vs_roofline']:.2f}x); "
              f"staggered contexts {row['staggered_ms_per_step']:7.2f} ms/step ({row['staggered_vs_contiguous']:.3f}x)")
    save()
    print(f"wrote {out / 'paged_kv.json'} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
