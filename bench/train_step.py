"""Training-engine check and speed under several (pp, dp, tp) layouts, on GPUs (NCCL) or CPU.

    python bench/train_step.py --out runs/bench-train          # every GPU here, Llama-3.2-1B shape, bf16
    python bench/train_step.py --out runs/bench-train --tiny   # any machine: tiny shape, 4 CPU ranks

In one launch (one process per rank):
1. parity: a tiny random checkpoint takes one float32 step under every layout; the updated
   weights, gathered into HF checkpoints, are compared with the single-rank step's (max |diff|).
   On GPUs this checks the NCCL paths: batched point-to-point of the 1F1B schedule, gradient
   buckets reduced from backward hooks, partial-gradient and tied-embedding sums;
2. speed: random weights of the model shape (bf16 on GPU, float32 on CPU) under every layout
   that fits; after one warm-up step, ``--steps`` steps of a token-mean loss over a batch of
   variable-length sequences: ms per step, real tokens per second, model TFLOP/s per device,
   padding overhead, peak memory, and (CUDA) host synchronisations per step, as reported by
   ``torch.cuda.set_sync_debug_mode``. Expected: two per step (normalizer and metrics); the
   micro-batches' tensors reach the device by copies that do not wait (``data.batch.to_device``);
3. with ``--profile`` (GPU): a kernel-level profile of one step of the first layout on rank 0,
   device time by kind (matrix products, attention, optimizer, the rest), the top kernels, and the
   device's idle time charged to what the host was doing then (``device_idle``).
``--model qwen3-1.7b --batch 256 --max-len 576 --equal-lengths --compile`` is the shape of
``bench/iteration.py``'s GRPO training call with every sample's prompt in its own row; the call as
the iteration runs it (a prompt held once for its samples) is profiled by ``bench/shared_prompts.py
--profile``.
Prints a table and writes ``train_step.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import SHAPES as ITERATION_SHAPES  # noqa: E402
QWEN3_1_7B = ITERATION_SHAPES["qwen3-1.7b"]

from shardflow.config.experiment import OptimConfig  # noqa: E402
from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.data.batch import SequenceBatch  # noqa: E402
from shardflow.engine.micro_batches import split_by_tokens  # noqa: E402
from shardflow.engine.train.engine import TrainEngine  # noqa: E402
from shardflow.models.checkpoint import load_model, save_checkpoint  # noqa: E402
from shardflow.models.transformer import build_model  # noqa: E402
from shardflow.parallel.launch import launch  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=True)
SHAPES = {"llama-3.2-1b": ("llama", LLAMA_1B), "qwen3-1.7b": ("qwen3", QWEN3_1_7B)}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)


class TokenMeanLoss:
    """A policy-gradient-shaped token-mean loss: -(advantage * logprob) over response tokens."""

    entropy_grad = False

    def normalizer(self, batch: SequenceBatch) -> float:
        return float(batch.token_fields["loss_mask"].sum())

    def __call__(self, outputs, mb, normalizer):
        mask, adv = mb.token_fields["loss_mask"], mb.token_fields["advantages"]
        loss = -(adv * outputs["logprobs"] * mask).sum() / normalizer
        return loss, {"entropy": (outputs["entropy"] * mask).sum().detach() / normalizer}


def make_batch(num: int, max_len: int, vocab: int, seed: int, equal: bool = False) -> SequenceBatch:
    """Lengths uniform in [max_len / 8, max_len] (all ``max_len`` if ``equal``); the first quarter
    of each is the prompt."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, max_len // 8), max_len + 1, (num,), generator=g).tolist()
    if equal:
        lengths = [max_len] * num
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    mask = [(torch.arange(n) >= n // 4).float() for n in lengths]
    adv = [torch.randn(n, generator=g) for n in lengths]
    return SequenceBatch.from_lists(range(num), {"input_ids": ids, "loss_mask": mask, "advantages": adv})


def share(batch: SequenceBatch, layout: Layout, rank: int) -> SequenceBatch:
    d = layout.coord(rank).dp
    return batch.select(list(range(d, len(batch), layout.dp)))


def default_layouts(n: int) -> list[str]:
    options = {1: ["d1p1t1"], 2: ["d1p1t1", "d2p1t1", "d1p2t1", "d1p1t2"],
               4: ["d1p1t1", "d4p1t1", "d1p1t4", "d2p2t1", "d1p2t2", "d2p1t2"],
               8: ["d1p1t1", "d8p1t1", "d1p1t8", "d2p2t2", "d1p2t4", "d4p1t2", "d1p4t2"]}
    return options.get(n, ["d1p1t1"])


def layout_of(shape: str) -> Layout:
    dp, pp, tp = (int(x) for x in shape[1:].replace("p", " ").replace("t", " ").split())
    return Layout.contiguous(pp=pp, dp=dp, tp=tp)


def parity(world, shapes: list[str], ckpt: str, out: Path) -> dict[str, float]:
    """Max |weight difference| after one float32 step, per layout, against d1p1t1."""
    cfg = ModelConfig.from_pretrained(ckpt)
    batch = make_batch(12, 96, cfg.vocab_size, seed=0)
    optim = OptimConfig(lr=1e-3, eps=1e-3, grad_clip=1.0)
    for shape in ["d1p1t1"] + shapes:
        layout = layout_of(shape)
        if world.rank in layout:
            model, _ = load_model(ckpt, layout, world, dtype=torch.float32)
            engine = TrainEngine(model, layout, world, optim, bucket_numel=1 << 16)
            engine.step(share(batch, layout, world.rank), TokenMeanLoss(), micro_batch_tokens=256)
            save_checkpoint(model, cfg, layout, world.rank, out / "parity" / shape)
            engine.close()
        world.barrier()
    diffs = {}
    if world.rank == 0:
        from safetensors.torch import load_file

        ref = load_file(out / "parity" / "d1p1t1" / "model.safetensors")
        for shape in shapes:
            got = load_file(out / "parity" / shape / "model.safetensors")
            diffs[shape] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    return diffs


def random_model(cfg: ModelConfig, layout: Layout, world, dtype: torch.dtype):
    shard = shard_for(cfg, layout, world.rank)
    model = build_model(cfg, shard, world.groups.get(layout.tp_group(world.rank)), world.device, dtype)
    g = torch.Generator(device=world.device).manual_seed(world.rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return model


def speed(world, shapes: list[str], cfg: ModelConfig, args) -> list[dict]:
    cuda = world.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = make_batch(args.batch, args.max_len, cfg.vocab_size, seed=1, equal=args.equal_lengths)
    lengths = batch.lengths.tolist()
    real = sum(lengths)
    # training FLOPs: 3 x forward; forward = 2 x the layers' matrix parameters per token, the LM head
    # at the tokens whose log-probabilities the loss reads (loss_mask, not a sequence's first), and
    # causal attention
    heads = sum(int((m[1:] > 0).sum()) for m in batch.token_fields["loss_mask"].split(lengths))
    attn = sum(2 * 2 * cfg.num_layers * cfg.q_size * n * n / 2 for n in lengths)
    flops = 3 * (2 * (cfg.num_layers * cfg.layer_params() * real + cfg.vocab_size * cfg.hidden_size * heads) + attn)
    rows = []
    for shape in shapes:
        layout = layout_of(shape)
        row = None  # this rank's measurement, when it is in the layout
        if world.rank in layout:
            row = {"layout": shape, "tokens": real}
            try:
                model = random_model(cfg, layout, world, dtype)
                if args.compile and cuda and layout.tp == 1:
                    model.compile_layers()
                engine = TrainEngine(model, layout, world, OptimConfig(lr=1e-6),
                                     gradient_checkpointing=args.checkpointing)
                mine = share(batch, layout, world.rank)
                step = lambda: engine.step(mine, TokenMeanLoss(), micro_batch_tokens=args.tokens)  # noqa: E731
                step()
                times = []
                for _ in range(args.steps):
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    metrics = step()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                syncs = None
                if cuda:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("warn")
                        step()
                        torch.cuda.set_sync_debug_mode("default")
                    syncs = sum("synchroniz" in str(w.message) for w in caught)
                if args.profile and cuda and world.rank == 0 and shape == shapes[0]:
                    row["profile"] = kernel_profile(step)
                groups = split_by_tokens(mine.lengths, args.tokens, min_micro_batches=layout.pp)
                padded = sum(len(g) * max(mine.lengths[g].tolist()) for g in groups)
                seconds = statistics.median(times)
                row.update(ms_per_step=1e3 * seconds, tokens_per_s=real / seconds,
                           tflops_per_device=flops / seconds / layout.size / 1e12,
                           padding=padded / mine.num_tokens - 1, syncs_per_step=syncs,
                           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                           grad_norm=metrics["grad_norm"], micro_batches=len(groups))
                engine.close()
                del engine, model
            except torch.OutOfMemoryError:
                row = {"layout": shape, "error": "out of memory"}
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        gathered = [None] * world.size
        dist.all_gather_object(gathered, row)
        measured = [r for r in gathered if r is not None]
        if any("error" in r for r in measured):
            rows.append({"layout": shape, "error": "out of memory"})
            continue
        merged = dict(measured[0])  # rank 0 of the layout (step time ends in a global all-reduce)
        if cuda:
            merged["peak_gib"] = max(r["peak_gib"] for r in measured)
        rows.append(merged)
    return rows


# Kinds of kernel by words of their names, the first kind that matches: attention before matrix
# products (a fused attention kernel's name may hold a product's word); "triton_tem" names
# inductor's Triton templates (its matrix products under max-autotune, epilogues fused in).
KINDS = (("attention", ("flash", "fmha", "attention")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce", "triton_tem")),
         ("optimizer", ("multi_tensor", "foreach", "adam")))


def kernel_profile(step) -> dict:
    """Device time of one step by kind of kernel, the top kernels, and where the device waited on
    the host (``device_idle``). The host's ops are recorded too (for the idle time's attribution),
    which slows the host: the profiled step's wall time is above an unprofiled one's."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return {"wall_ms": wall * 1e3, **device_time(trace), "idle": device_idle(trace)}


def device_time(trace: dict, top: int = 40) -> dict:
    """A chrome trace's device work summed by kind of kernel (``KINDS``) and by name."""
    by_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK:
            entry = by_name.setdefault(str(e.get("name", "")), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0)) / 1e3
    kinds: dict[str, float] = {}
    for name, (_, ms) in by_name.items():
        kind = next((k for k, words in KINDS if any(w in name.lower() for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"device_ms_by_kind": kinds,
            "top": [dict(name=name[:120], calls=calls, ms=ms) for name, (calls, ms) in ranked[:top]]}


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def device_idle(trace: dict, *, min_gap_us: float = 20.0) -> dict:
    """Where a profiled step's device had nothing to run (a chrome trace of host and device).

    The device's busy time is the union of its kernels, copies and fills; every gap between them
    longer than ``min_gap_us`` (shorter ones are the launch latency between queued kernels) is
    charged to the innermost ``record_function`` range of the host (``shardflow.*``, see
    ``engine.train.engine``) and the host ops running at the gap's middle (outermost > innermost):
    what the host was doing while the device waited. Idle time before the first device work counts
    too; ``short_idle_ms`` is the rest, the gaps under ``min_gap_us``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    busy = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                  if e.get("cat") in DEVICE_WORK)
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    if not busy or not host:
        return {}
    begin = min(float(e["ts"]) for e in host)
    gaps, end = [], begin
    for a, b in busy:
        if a - end > min_gap_us:
            gaps.append((end, a))
        end = max(end, b)
    by_range: dict[str, float] = {}
    rows = []
    for (a, b), (marks, ops) in zip(gaps, _running(host, [(a + b) / 2 for a, b in gaps])):
        mark = next((str(e["name"]) for e in reversed(marks) if str(e["name"]).startswith("shardflow.")), "-")
        op = " > ".join(dict.fromkeys(str(e["name"])[:60] for e in (ops[:1] + ops[-1:]))) or "-"
        by_range[mark] = by_range.get(mark, 0.0) + (b - a) / 1e3
        rows.append({"ms": (b - a) / 1e3, "at_ms": (a - begin) / 1e3, "range": mark, "host_op": op})
    rows.sort(key=lambda r: -r["ms"])
    return {"span_ms": (end - begin) / 1e3, "busy_ms": sum(b - a for a, b in _merged(busy)) / 1e3,
            "idle_ms": sum(b - a for a, b in gaps) / 1e3, "gaps": len(gaps),
            "short_idle_ms": (end - begin - sum(b - a for a, b in _merged(busy)) - sum(b - a for a, b in gaps)) / 1e3,
            "idle_ms_by_range": dict(sorted(by_range.items(), key=lambda kv: -kv[1])), "longest": rows[:15]}


def _running(events: list[dict], times: list[float]) -> list[tuple[list[dict], list[dict]]]:
    """For each of the ascending ``times``: the annotations and the ops running then, outermost first."""
    events = sorted(events, key=lambda e: float(e["ts"]))
    out, active, i = [], [], 0
    for t in times:
        while i < len(events) and float(events[i]["ts"]) <= t:
            active.append(events[i])
            i += 1
        active = [e for e in active if float(e["ts"]) + float(e.get("dur", 0)) >= t]
        out.append(([e for e in active if e.get("cat") == "user_annotation"],
                    [e for e in active if e.get("cat") != "user_annotation"]))
    return out


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def print_idle(idle: dict) -> None:
    """``device_idle``'s summary, a few lines."""
    if not idle:
        return
    ranges = ", ".join(f"{k} {v:.1f} ms" for k, v in idle["idle_ms_by_range"].items())
    print(f"  device idle {idle['idle_ms']:.1f} ms in {idle['gaps']} gaps over {idle['span_ms']:.0f} ms "
          f"(busy {idle['busy_ms']:.0f} ms, {idle['short_idle_ms']:.1f} ms in shorter gaps); by host range: {ranges}")
    for g in idle["longest"][:8]:
        print(f"    {g['ms']:7.2f} ms at {g['at_ms']:7.1f} ms  {g['range']}  ({g['host_op']})")


def rank_main(world, args, ckpt: str) -> None:
    shapes = [s for s in args.layouts.split(",") if layout_of(s).size <= world.size]
    world.create_groups([layout_of(s) for s in set(shapes) | {"d1p1t1"}])
    out = Path(args.out)
    diffs = parity(world, shapes, ckpt, out)
    cfg = ModelConfig.from_hf_dict(json.loads(args.shape_json))
    rows = speed(world, shapes, cfg, args)
    if world.rank != 0:
        return
    for row in rows:
        row["parity_max_abs_diff"] = diffs.get(row["layout"])
    device = torch.cuda.get_device_name() if world.device.type == "cuda" else "cpu"
    print(f"training step, {args.model} shape, {world.size} x {device}, batch {args.batch} sequences "
          f"of <= {args.max_len} tokens, micro-batch budget {args.tokens} tokens")
    print(f"{'layout':8} {'ms/step':>9} {'tok/s':>10} {'TFLOP/s/dev':>11} {'pad':>6} {'syncs':>5} "
          f"{'peak GiB':>8} {'parity':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:8} {r['error']}")
            continue
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['layout']:8} {r['ms_per_step']:9.1f} {r['tokens_per_s']:10.0f} {r['tflops_per_device']:11.2f} "
              f"{r['padding']:6.1%} {fmt(r['syncs_per_step'], 'd'):>5} {fmt(r['peak_gib'], '.1f'):>8} "
              f"{fmt(r['parity_max_abs_diff'], '.1e'):>9}")
        if "profile" in r:
            p = r["profile"]
            kinds = ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(p["device_ms_by_kind"].items(), key=lambda kv: -kv[1]))
            print(f"  profiled step: {p['wall_ms']:.0f} ms wall; device time: {kinds}")
            print_idle(p["idle"])
            for k in p["top"]:
                print(f"    {k['ms']:8.1f} ms x{k['calls']:<5} {k['name']}")
    record = {"device": device, "ranks": world.size, "model": args.model, "batch": args.batch,
              "max_len": args.max_len, "micro_batch_tokens": args.tokens, "steps": args.steps,
              "gradient_checkpointing": args.checkpointing, "compile": args.compile,
              "equal_lengths": args.equal_lengths, "rows": rows}
    (out / "train_step.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / 'train_step.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for train_step.json and parity checkpoints")
    parser.add_argument("--tiny", action="store_true", help="tiny shape and small batch (CPU check)")
    parser.add_argument("--nprocs", type=int, default=None, help="ranks (default: GPUs here, or 4 on CPU)")
    parser.add_argument("--layouts", default=None, help="comma list like d1p2t4,d2p2t2 (default: by rank count)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 64; tiny 16)")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence (default 2048; tiny 128)")
    parser.add_argument("--tokens", type=int, default=None, help="micro-batch token budget (default 16384; tiny 512)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama-3.2-1b", help="model shape (GPU)")
    parser.add_argument("--equal-lengths", action="store_true", help="every sequence --max-len tokens")
    parser.add_argument("--compile", action="store_true", help="torch.compile the layers (tp=1, GPU), as runs do")
    parser.add_argument("--profile", action="store_true", help="kernel profile of one step (GPU)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    args.nprocs = args.nprocs or (gpus if gpus else 4)
    args.layouts = args.layouts or ",".join(default_layouts(args.nprocs))
    args.batch = args.batch or (16 if args.tiny else 64)
    args.max_len = args.max_len or (128 if args.tiny else 2048)
    args.tokens = args.tokens or (512 if args.tiny else 16384)
    family, shape = ("llama", TINY) if args.tiny else SHAPES[args.model]
    args.model = "tiny" if args.tiny else args.model

    from shardflow.models.tiny import make_tiny_checkpoint, tiny_hf_config

    hf = tiny_hf_config(family, **shape).to_dict()
    args.shape_json = json.dumps(hf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # 8 heads over 2 KV heads: tp=8 replicates KV heads; 4 layers allow pp=4.
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", "llama", num_hidden_layers=4, tie_word_embeddings=True,
                                    hidden_size=128, intermediate_size=256, num_attention_heads=8,
                                    num_key_value_heads=2)
        launch(rank_main, args.nprocs, args, str(ckpt))


if __name__ == "__main__":
    main()
