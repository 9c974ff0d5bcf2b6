"""Reallocation bandwidth: bytes, time and GB/s per layout pair, against the point-to-point
bandwidth of the same machine measured in the same run.

For each pair SRC:DST every rank builds its source shard with random weights (the same values
for every layout: each tensor is drawn from a seed of its name, then sliced), preallocates its
destination shard, reallocates once to warm up and check the result bit for bit, then times
``--repeat`` reallocations. The reference moves exactly the same bytes between the same ranks as
one flat message per (sender, receiver) pair in one batch: the best the links can do for that
traffic. Raw point-to-point bandwidth between ranks 0 and 1 (one way and both ways) is printed too.

    python bench/realloc.py --out runs/bench-realloc                 # GPUs: NCCL, bf16, LLaMA-3.1-8B shape
    python bench/realloc.py --model small --out runs/bench-realloc   # no GPU: gloo, float32, small model

Pairs are written ``d1t2:d2t1`` (ranks from 0) or with ranks, ``d1t1@0:d1t1@1``; ``p`` is
optional (``d1p2t2``). Writes ``realloc.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.models.transformer import build_model  # noqa: E402
from shardflow.parallel import comm  # noqa: E402
from shardflow.parallel.launch import launch  # noqa: E402
from shardflow.parallel.layout import Layout, parse_ranks  # noqa: E402
from shardflow.parallel.realloc import BUCKET_BYTES, DIRECT_MIN_BYTES, reallocate  # noqa: E402
from shardflow.parallel.realloc_plan import transfer_plan  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 131072, "tie_word_embeddings": False}
MODELS = {
    # LLaMA-3.1-8B: 8.0e9 parameters, 16 GB in bf16.
    "8b": {**LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}},
    # 0.13e9 parameters, for CPU runs.
    "small": {**LLAMA, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096,
              "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "rope_theta": 1e4},
    "tiny": {**LLAMA, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e4},
}
_PAIR_SIDE = re.compile(r"^d(\d+)(?:p(\d+))?t(\d+)(?:@([0-9,\-]+))?$")


def parse_side(text: str) -> Layout:
    m = _PAIR_SIDE.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse layout {text!r}; expected e.g. 'd2t1', 'd1p2t2' or 'd1t1@1'")
    dp, pp, tp = int(m.group(1)), int(m.group(2) or 1), int(m.group(3))
    ranks = parse_ranks(m.group(4)) if m.group(4) else tuple(range(dp * pp * tp))
    return Layout(ranks, pp=pp, dp=dp, tp=tp)


def parse_pairs(text: str) -> list[tuple[str, Layout, Layout]]:
    pairs = []
    for item in text.split(","):
        if item.count(":") != 1:
            raise ValueError(f"pair {item!r} must be SRC:DST, e.g. d2t1:d1t2")
        a, b = item.split(":")
        pairs.append((item, parse_side(a), parse_side(b)))
    return pairs


# ----- weights ----------------------------------------------------------------------------------


def expected_local(ts, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This shard's slice of the full tensor drawn from a seed of the tensor's name."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(ts.source.encode()))
    full = torch.randn(ts.full_shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    local = torch.zeros(ts.local_shape, dtype=dtype, device=device)
    local[ts.local_slices()] = full[ts.full_slices()]
    return local


@torch.no_grad()
def random_model(cfg, layout, world, dtype):
    shard = shard_for(cfg, layout, world.rank)
    model = build_model(cfg, shard, world.groups.get(layout.tp_group(world.rank)), world.device, dtype)
    for name, p in model.named_parameters():
        p.copy_(expected_local(shard.tensors[name], dtype, world.device))
    return model


@torch.no_grad()
def verify(cfg, layout, world, model, dtype) -> bool:
    shard = shard_for(cfg, layout, world.rank)
    return all(torch.equal(p, expected_local(shard.tensors[n], dtype, world.device))
               for n, p in model.named_parameters())


# ----- timing -----------------------------------------------------------------------------------


def _sync(world) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def timed_exchange(world, sends, recvs) -> float:
    """Seconds for one batch of sends and receives, between two barriers."""
    dist.barrier()
    _sync(world)
    start = time.perf_counter()
    for w in comm.batch_isend_irecv(sends, recvs):
        w.wait()
    _sync(world)
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


def raw_p2p(world, nbytes: int, repeat: int, dtype: torch.dtype) -> dict[str, float]:
    """GB/s between ranks 0 and 1: one way, and both ways at once (per direction)."""
    if world.size < 2:
        return {}
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    out = torch.ones(numel, dtype=dtype, device=world.device)
    into = torch.empty_like(out)
    peer = 1 - world.rank if world.rank < 2 else None
    results = {}
    for kind in ("one_way", "both_ways"):
        sends, recvs = [], []
        if peer is not None:
            if kind == "both_ways" or world.rank == 0:
                sends.append((out, peer))
            if kind == "both_ways" or world.rank == 1:
                recvs.append((into, peer))
        times = [timed_exchange(world, sends, recvs) for _ in range(repeat + 1)][1:]
        results[f"{kind}_gbps"] = nbytes / min(times) / 1e9
    return results


def matched_traffic(world, plan, itemsize: int, dtype: torch.dtype):
    """One flat buffer per peer and direction, holding what the plan moves between them."""
    def buf(transfers):
        return torch.empty(sum(t.numel for t in transfers), dtype=dtype, device=world.device)
    sends = [(buf(ts), peer) for peer, ts in sorted(plan.sends(world.rank).items())]
    recvs = [(buf(ts), peer) for peer, ts in sorted(plan.recvs(world.rank).items())]
    return sends, recvs


def bench_pair(world, cfg, src: Layout, dst: Layout, dtype, repeat: int, options: dict, check: bool) -> dict:
    world.create_groups([src, dst])
    plan = transfer_plan(cfg, src, dst)
    me = world.rank
    src_model = random_model(cfg, src, world, dtype) if me in src else None
    dst_model = build_model(cfg, shard_for(cfg, dst, me), world.groups.get(dst.tp_group(me)), world.device,
                            dtype) if me in dst else None
    src_params = dict(src_model.named_parameters()) if src_model is not None else None
    dst_params = dict(dst_model.named_parameters()) if dst_model is not None else None

    dist.barrier()
    reallocate(world, cfg, src, dst, src_params, dst_params, **options)  # warm-up (and connections)
    ok = verify(cfg, dst, world, dst_model, dtype) if check and dst_model is not None else None
    runs = []
    for _ in range(repeat):
        dist.barrier()
        runs.append(reallocate(world, cfg, src, dst, src_params, dst_params, **options))
    dist.barrier()
    del src_model, dst_model, src_params, dst_params
    if world.device.type == "cuda":
        torch.cuda.empty_cache()

    sends, recvs = matched_traffic(world, plan, torch.empty((), dtype=dtype).element_size(), dtype)
    reference = [timed_exchange(world, sends, recvs) for _ in range(repeat + 1)][1:]
    del sends, recvs
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"verified": ok, "runs": [vars(r) for r in runs], "reference_seconds": reference}


def summarize(name: str, src: Layout, dst: Layout, per_rank: list[dict]) -> dict:
    repeat = len(per_rank[0]["runs"])
    seconds = [max(r["runs"][i]["seconds"] for r in per_rank) for i in range(repeat)]
    ref = [max(r["reference_seconds"][i] for r in per_rank) for i in range(repeat)]
    first = [r["runs"][0] for r in per_rank]
    moved = sum(s["bytes_received"] for s in first)
    busiest = max(max(s["bytes_sent"], s["bytes_received"]) for s in first)
    best, best_ref = min(seconds), min(ref)
    checks = [r["verified"] for r in per_rank if r["verified"] is not None]
    return {
        "pair": name, "src": str(src), "dst": str(dst),
        "bytes_moved": moved, "bytes_copied": sum(s["bytes_copied"] for s in first),
        "busiest_rank_bytes": busiest, "messages": sum(s["messages"] for s in first),
        "seconds_best": best, "seconds_median": statistics.median(seconds),
        "gbps": moved / best / 1e9 if moved else 0.0,
        "busiest_link_gbps": busiest / best / 1e9 if busiest else 0.0,
        "reference_seconds_best": best_ref,
        "reference_gbps": moved / best_ref / 1e9 if moved else 0.0,
        "fraction_of_reference": best_ref / best if moved else None,
        "verified": all(checks) if checks else None,
    }


def bench_ranks(world, args_dict: dict, runnable: list[tuple[str, str, str]]) -> None:
    args = argparse.Namespace(**args_dict)
    cfg = ModelConfig.from_hf_dict(MODELS[args.model])
    dtype = getattr(torch, args.dtype)
    options = dict(bucket_bytes=int(args.bucket_mb * 2**20), direct_min_bytes=int(args.direct_min_mb * 2**20))
    dist.barrier()  # the default group's first operation involves every rank
    p2p = raw_p2p(world, int(args.p2p_mb * 2**20), args.repeat, dtype)
    results = []
    for name, src_text, dst_text in runnable:
        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        mine = bench_pair(world, cfg, src, dst, dtype, args.repeat, options, not args.no_verify)
        gathered = [None] * world.size
        dist.all_gather_object(gathered, mine)
        results.append(summarize(name, src, dst, gathered))
    if world.rank == 0:
        report(args, cfg, world, p2p, results)


def report(args, cfg, world, p2p: dict, results: list[dict]) -> None:
    device = torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else "cpu"
    print(f"\nreallocation of {args.model} ({cfg.num_params() / 1e9:.2f}e9 params, {args.dtype}) "
          f"on {world.size} x {device}, {world.backend}")
    if p2p:
        print(f"raw point-to-point rank 0 <-> 1: one way {p2p['one_way_gbps']:.1f} GB/s, "
              f"both ways {p2p['both_ways_gbps']:.1f} GB/s per direction")
    print(f"{'pair':<24}{'moved GB':>10}{'local GB':>10}{'ms':>10}{'GB/s':>9}{'ref GB/s':>10}{'of ref':>8}"
          f"{'msgs':>7}  verified")
    for r in results:
        frac = f"{100 * r['fraction_of_reference']:.0f}%" if r["fraction_of_reference"] is not None else "-"
        print(f"{r['pair']:<24}{r['bytes_moved'] / 1e9:>10.3f}{r['bytes_copied'] / 1e9:>10.3f}"
              f"{r['seconds_best'] * 1e3:>10.2f}{r['gbps']:>9.1f}{r['reference_gbps']:>10.1f}{frac:>8}"
              f"{r['messages']:>7}  {r['verified']}")
    payload = {"model": args.model, "params": cfg.num_params(), "dtype": args.dtype, "device": device,
               "backend": world.backend, "ranks": world.size, "bucket_mb": args.bucket_mb,
               "direct_min_mb": args.direct_min_mb, "raw_p2p": p2p, "pairs": results,
               "skipped": args.skipped}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "realloc.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out / 'realloc.json'}")


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for realloc.json")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b" if gpu else "small")
    parser.add_argument("--pairs", default="d1t2:d2t1,d2t1:d1t2,d1t1@0:d1t1@1",
                        help="comma-separated SRC:DST layouts")
    parser.add_argument("--ranks", type=int, default=None, help="ranks to start (default: what the pairs need)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if gpu else "gloo")
    parser.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per pair (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / 2**20)
    parser.add_argument("--direct-min-mb", type=float, default=DIRECT_MIN_BYTES / 2**20)
    parser.add_argument("--p2p-mb", type=float, default=1024 if gpu else 64, help="raw point-to-point message size")
    parser.add_argument("--no-verify", action="store_true", help="skip the bitwise check of the result")
    args = parser.parse_args(argv)

    cfg = ModelConfig.from_hf_dict(MODELS[args.model])
    pairs = parse_pairs(args.pairs)
    for name, a, b in pairs:
        transfer_plan(cfg, a, b)  # a layout the model cannot take is an error before anything starts
    available = torch.cuda.device_count() if args.backend == "nccl" else None
    ranks = args.ranks or max(max(a.ranks + b.ranks) + 1 for _, a, b in pairs)
    if available is not None and ranks > available:
        ranks = available
    runnable, args.skipped = [], []
    for name, a, b in pairs:
        need = max(a.ranks + b.ranks) + 1
        if need > ranks:
            where = f"this machine has {available} GPU(s)" if available is not None else f"--ranks is {ranks}"
            print(f"SKIPPED {name}: needs {need} ranks, {where}", file=sys.stderr)
            args.skipped.append({"pair": name, "needs_ranks": need, "available": ranks})
        else:
            runnable.append((name, str(a), str(b)))
    if not runnable:
        print("nothing to run: every pair needs more ranks than are available", file=sys.stderr)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "realloc.json").write_text(json.dumps({"model": args.model, "pairs": [], "skipped": args.skipped},
                                                     indent=2) + "\n")
        return 2
    launch(bench_ranks, ranks, vars(args), runnable, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
