"""``shardflow profile``: measure on this hardware what the cost model needs, for one model shape.

For every tp, one decoder layer as one tp rank holds it (built from the sharding spec, run on one
GPU without communication) is timed: forward and backward over token counts and sequence lengths,
a decode step over batch sizes and KV-cache lengths, and the AdamW step per parameter; the
layer's attention alone, causal and as shared prompts pack it, over the same grid; the final
norm and head likewise over token counts. The GEMM rate and copy bandwidth are measured too, and
with several GPUs the all-reduce bus bandwidth and point-to-point bandwidth between them.

What is timed is what the runtime runs: on GPUs, tp=1 layers go through ``torch.compile`` as the
runtime compiles them (``compile_layers=False`` for runs that keep them eager), and a decode step
attends with the engine's decode attention over a cache in the engine's layout (the engine's own
decode layer, compiled at tp=1 on GPUs as the engine compiles it). Decode steps are
timed eagerly by default (kernel launches included), or as captured CUDA graphs with
``cuda_graphs`` to match an engine that replays graphs. Grid cells whose KV cache would not fit are
filled from the roofline scaled by the nearest measured cell.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from shardflow.config.model import ModelConfig
from shardflow.engine.compile_fallback import compiled_or_eager
from shardflow.engine.generate.decode_attention import ATTENTION
from shardflow.engine.generate.decode_weights import make_decode_weights
from shardflow.engine.generate.steps import decode_layer, step_compile_options
from shardflow.models.packed_attention import PackedSequences, packed_attention
from shardflow.models.transformer import Transformer, build_model, causal_attention
from shardflow.parallel.launch import launch
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import HeadProfile, LayerProfile, Profile, Table, head_key, layer_key
from shardflow.perf.roofline import LayerShape, Roofline, layer_shape
from shardflow.plan.space import splits

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Grid:
    tokens: tuple[int, ...] = (1024, 4096, 8192, 16384, 32768)  # per micro-batch
    seqlens: tuple[int, ...] = (256, 1024, 4096)
    batches: tuple[int, ...] = (1, 8, 32, 128, 256)  # decode
    contexts: tuple[int, ...] = (256, 1024, 4096, 8192)
    head_tokens: tuple[int, ...] = (256, 1024, 4096, 16384)
    reps: int = 10
    kv_budget_bytes: float = 24e9  # a decode cell's KV cache must fit in this


QUICK = Grid(tokens=(32, 128), seqlens=(16, 64), batches=(1, 4), contexts=(16, 64), head_tokens=(16, 64), reps=2,
             kv_budget_bytes=1e8)


def timed(fn: Callable[[], object], device: torch.device, reps: int, rounds: int = 3) -> float:
    """Median over rounds of the mean seconds per call (after a warm-up call)."""
    fn()
    results = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            results.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            results.append((time.perf_counter() - t0) / reps)
    return statistics.median(results)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture ``fn`` (static shapes, no host sync) as a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up allocator and kernels outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_rates(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Dense GEMM FLOP/s and device copy bandwidth (bytes read + written per second)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / timed(lambda: a @ b, device, 10 if device.type == "cuda" else 3)
    numel = (2**30 if device.type == "cuda" else 2**24) // 4
    x = torch.empty(numel, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / timed(lambda: y.copy_(x), device, 10)
    return {"matmul_flops": flops, "hbm_bandwidth": bandwidth}


def one_layer_model(cfg: ModelConfig, tp: int, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The rank-0 shard of a one-layer copy of the model under tp: embedding, one decoder layer,
    final norm and head, with random weights."""
    small = dataclasses.replace(cfg, num_layers=1, sliding_windows=cfg.sliding_windows[:1])
    model = build_model(small, shard_for(small, Layout.contiguous(tp=tp), 0), None, device, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def _positions(batch: int, length: int, device: torch.device, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).expand(batch, length)  # [B,T]


def profile_layer(cfg: ModelConfig, tp: int, grid: Grid, device: torch.device, dtype: torch.dtype, *,
                  cuda_graphs: bool = False, compile_layers: bool = True, transposed_weights: bool = False,
                  roofline: Roofline = Roofline(), cluster: Cluster | None = None) -> LayerProfile:
    model = one_layer_model(cfg, tp, device, dtype)
    layer = model.model.layers["0"]
    H = cfg.hidden_size
    compiled = compile_layers and device.type == "cuda" and tp == 1  # as the runtime compiles them
    if compiled:
        model.compile_layers()
    run = model.layer_fn(None)  # training and inference forwards
    decode_attention = ATTENTION["triton" if device.type == "cuda" else "torch"]  # the engine's default

    def layer_cell(tokens: int, seqlen: int, backward: bool) -> float:
        # cells with seqlen > tokens run one sequence of `tokens` tokens
        length = min(seqlen, tokens)
        batch = max(1, tokens // length)
        cos, sin = model.rope(_positions(batch, length, device), dtype)
        x = torch.randn(batch, length, H, device=device, dtype=dtype)  # [B,T,H]
        if not backward:
            with torch.no_grad():
                return timed(lambda: run(layer, x, cos, sin, None), device, grid.reps)
        x.requires_grad_(True)
        grad = torch.randn_like(x)

        def step():
            run(layer, x, cos, sin, None).backward(grad)

        with torch.no_grad():
            forward = timed(lambda: run(layer, x, cos, sin, None), device, grid.reps)
        return max(timed(step, device, grid.reps) - forward, 0.1 * forward)

    forward = tuple(tuple(layer_cell(t, s, False) for s in grid.seqlens) for t in grid.tokens)
    backward = tuple(tuple(layer_cell(t, s, True) for s in grid.seqlens) for t in grid.tokens)
    model.zero_grad(set_to_none=True)

    shape = layer_shape(cfg, tp)
    attention = {f"{kind}_{way}": Table(grid.tokens, tuple(tuple(
        attention_cell(shape, cfg.head_dim, t, s, packed=kind == "packed", backward=way == "backward", device=device,
                       dtype=dtype, reps=grid.reps) for s in grid.seqlens) for t in grid.tokens), grid.seqlens)
        for kind in ("attention", "packed") for way in ("forward", "backward")}
    kv_local = shape.kv_dim // cfg.head_dim
    # The engine decodes with fused q/k/v and gate/up copies on GPUs (every product's weight stored
    # transposed with ``transposed_weights``) and compiles its decode layer at tp=1: so does this.
    if device.type == "cuda" or transposed_weights:
        make_decode_weights(model, transposed=transposed_weights)
    decode = decode_layer
    if compiled:
        options, fallback = step_compile_options()  # the engine's default settings
        decode = compiled_or_eager(decode_layer, "the profiled decode layer", fallback=fallback, **options)
    rows: list[list[float | None]] = []
    for batch in grid.batches:
        row: list[float | None] = []
        for context in grid.contexts:
            kv_bytes = 2 * batch * (context + 1) * shape.kv_dim * torch.finfo(dtype).bits // 8
            if kv_bytes > grid.kv_budget_bytes:
                row.append(None)
                continue
            # the engine's cache layout: [slots, kv heads, positions, head dim], one slot per request
            k_cache = torch.randn(batch, kv_local, context + 1, cfg.head_dim, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            slots = torch.arange(batch, device=device)
            positions = torch.full((batch,), context, device=device)
            cos, sin = model.rope(positions[:, None], dtype)
            x, pending = torch.randn(2, batch, 1, H, device=device, dtype=dtype)  # [B,1,H] each
            with torch.no_grad():
                at = slots[:, None], positions[:, None]
                fn = lambda: decode(layer, x, pending, cos, sin, k_cache, v_cache, decode_attention,  # noqa: E731
                                    at, slots, positions + 1, None)
                if cuda_graphs and device.type == "cuda":
                    fn = graphed(fn)
                row.append(timed(fn, device, grid.reps))
            del k_cache, v_cache
        rows.append(row)
    filled = _fill(rows, grid, lambda b, c: roofline.decode_layer(shape, cluster or Cluster(), b, c))

    optimizer = measure_optimizer(list(layer.parameters()), device)
    return LayerProfile(forward=Table(grid.tokens, forward, grid.seqlens),
                        backward=Table(grid.tokens, backward, grid.seqlens),
                        decode=Table(grid.batches, filled, grid.contexts), optimizer_per_param=optimizer,
                        **attention)


def attention_cell(shape: LayerShape, head_dim: int, tokens: int, seqlen: int, *, packed: bool, backward: bool,
                   device: torch.device, dtype: torch.dtype, reps: int) -> float:
    """Seconds of one layer's attention alone over ``tokens`` tokens in sequences of ``seqlen``
    (forward, or backward): the causal attention of the layer's plain forward, or (``packed``) the
    packed-sequence attention that shared prompts run, here over unshared sequences, whose rows
    hold the same key slots (``models.packed_attention``: gathers into rows, then attention)."""
    length = min(seqlen, tokens)
    batch = max(1, tokens // length)
    n = batch * length
    q = torch.randn(n, shape.q_dim // head_dim, head_dim, device=device, dtype=dtype)  # [N,h,d]
    k, v = (torch.randn(n, shape.kv_dim // head_dim, head_dim, device=device, dtype=dtype) for _ in range(2))
    if packed:
        seqs = PackedSequences.build(torch.arange(n), [length] * batch, [length] * batch).to(device)
        attend = lambda: packed_attention(q, k, v, seqs)  # noqa: E731
    else:
        attend = lambda: causal_attention(*(t.view(batch, length, -1, head_dim).transpose(1, 2)  # noqa: E731
                                            for t in (q, k, v)), None)
    with torch.no_grad():
        forward = timed(attend, device, reps)
    if not backward:
        return forward
    for t in (q, k, v):
        t.requires_grad_(True)
    grad = torch.randn(n, shape.q_dim // head_dim, head_dim, device=device, dtype=dtype)

    def step():
        out = attend()  # packed: [N,h,d]; causal: [B,h,T,d]
        (out if packed else out.transpose(1, 2)).reshape(grad.shape).backward(grad)

    return max(timed(step, device, reps) - forward, 0.1 * forward)


def _fill(rows: list[list[float | None]], grid: Grid, roof: Callable[[int, int], float]) -> tuple:
    """Replace unmeasured cells by the roofline scaled like the nearest measured cell."""
    measured = [(i, j) for i, r in enumerate(rows) for j, v in enumerate(r) if v is not None]
    if not measured:
        raise RuntimeError("no decode cell fits in the KV budget; raise Grid.kv_budget_bytes")
    out = []
    for i, r in enumerate(rows):
        new = []
        for j, v in enumerate(r):
            if v is None:
                ni, nj = min(measured, key=lambda ij: (abs(ij[0] - i) + abs(ij[1] - j), ij))
                b, c = grid.batches[i], grid.contexts[j]
                v = roof(b, c) * rows[ni][nj] / roof(grid.batches[ni], grid.contexts[nj])
            new.append(v)
        out.append(tuple(new))
    return tuple(out)


def measure_optimizer(params: list[torch.nn.Parameter], device: torch.device) -> float:
    """Seconds per parameter of an AdamW step over fp32 master copies, copied back to the
    (bf16) parameters, as a mixed-precision trainer does."""
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    for m in masters:
        m.grad = torch.randn_like(m)
    kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(masters, lr=1e-6, **kwargs)

    def step():
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    n = sum(p.numel() for p in params)
    return timed(step, device, 5) / n


def profile_head(cfg: ModelConfig, tp: int, grid: Grid, device: torch.device, dtype: torch.dtype) -> HeadProfile:
    model = one_layer_model(cfg, tp, device, dtype)
    H = cfg.hidden_size

    def cell(tokens: int, backward: bool) -> float:
        hidden = torch.randn(1, tokens, H, device=device, dtype=dtype, requires_grad=backward)  # [1,T,H]
        targets = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)

        def head():
            h = model.model.norm(hidden)
            return model.values(h) if cfg.value_head else model.token_logprobs(h, targets)

        if not backward:
            with torch.no_grad():
                return timed(head, device, grid.reps)
        with torch.no_grad():
            forward = timed(head, device, grid.reps)
        return max(timed(lambda: head().sum().backward(), device, grid.reps) - forward, 0.1 * forward)

    return HeadProfile(forward=Table(grid.head_tokens, tuple(cell(t, False) for t in grid.head_tokens)),
                       backward=Table(grid.head_tokens, tuple(cell(t, True) for t in grid.head_tokens)))


def profile_model(cfg: ModelConfig, *, tps: tuple[int, ...], grid: Grid = Grid(), device: torch.device,
                  dtype: torch.dtype, cuda_graphs: bool = False, compile_layers: bool = True,
                  transposed_weights: bool = False) -> Profile:
    rates = measure_rates(device, dtype)
    logger.info(f"GEMM {rates['matmul_flops'] / 1e12:.1f} TFLOP/s, copy {rates['hbm_bandwidth'] / 1e9:.0f} GB/s")
    cluster = Cluster().with_rates(**rates)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = Profile(device=name, rates=rates)
    for tp in tps:
        if not splits(cfg, 1, tp):
            logger.info(f"tp={tp}: skipped, the model cannot be split that way")
            continue
        t0 = time.perf_counter()
        layer = profile_layer(cfg, tp, grid, device, dtype, cuda_graphs=cuda_graphs, compile_layers=compile_layers,
                              transposed_weights=transposed_weights, cluster=cluster)
        profile.layers.setdefault(layer_key(cfg), {})[tp] = layer
        profile.heads.setdefault(head_key(cfg), {})[tp] = profile_head(cfg, tp, grid, device, dtype)
        logger.info(f"tp={tp}: layer forward {layer.forward(grid.tokens[-1], grid.seqlens[0]) * 1e3:.3f} ms at "
             f"{grid.tokens[-1]} tokens, decode {layer.decode(grid.batches[0], grid.contexts[0]) * 1e6:.0f} us "
             f"at batch {grid.batches[0]} ({time.perf_counter() - t0:.0f} s)")
    return profile


# ----- links between GPUs ---------------------------------------------------------------------


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares t = a + b * size."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    b = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sum((x - mx) ** 2 for x in sizes)
    return max(my - b * mx, 0.0), max(b, 1e-30)


def measure_links(world, out_path: str, sizes: tuple[int, ...], reps: int = 5) -> None:
    """All-reduce over every rank and point-to-point from rank 0 to rank 1 (run on every rank);
    rank 0 writes the fitted bus bandwidth, latency and point-to-point bandwidth as JSON."""
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    elem = torch.finfo(dtype).bits // 8
    reduce_s, p2p_s = [], []
    for size in sizes:
        t = torch.ones(size // elem, device=world.device, dtype=dtype)

        def all_reduce(t=t):
            dist.all_reduce(t)

        def send_recv(t=t):
            if world.rank == 0:
                dist.send(t, dst=1)
            elif world.rank == 1:
                dist.recv(t, src=0)

        for fn, out in ((all_reduce, reduce_s), (send_recv, p2p_s)):
            world.barrier()
            out.append(timed(fn, world.device, reps, rounds=1))
    if world.rank == 0:
        n = world.size
        latency, per_byte = _fit(list(sizes), reduce_s)
        p2p_latency, p2p_per_byte = _fit(list(sizes), p2p_s)
        rates = {"intra_node_bandwidth": 2 * (n - 1) / n / per_byte, "intra_node_latency": max(latency, 1e-6),
                 "p2p_bandwidth": 1 / p2p_per_byte}
        Path(out_path).write_text(json.dumps(rates))


def run_profile(model: str, out: str, *, tps: str = "1,2,4,8", quick: bool = False, ranks: int | None = None,
                device: str | None = None, cuda_graphs: bool = False, compile_layers: bool = True,
                transposed_weights: bool = False) -> Profile:
    cfg = ModelConfig.from_pretrained(model)
    try:
        tp_list = tuple(int(t) for t in str(tps).split(",") if t)
    except ValueError:
        raise ValueError(f"--tp must be a comma-separated list of integers, got {tps!r}") from None
    if not tp_list or min(tp_list) < 1:
        raise ValueError(f"--tp needs positive tensor-parallel sizes, got {tps!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    profile = profile_model(cfg, tps=tp_list, grid=QUICK if quick else Grid(), device=dev, dtype=dtype,
                            cuda_graphs=cuda_graphs, compile_layers=compile_layers,
                            transposed_weights=transposed_weights)
    if ranks is None:
        ranks = torch.cuda.device_count() if dev.type == "cuda" else 0
    if ranks > 1:
        links = Path(out).with_suffix(".links.json")
        sizes = (2**16, 2**20, 2**23) if quick else (2**20, 2**23, 2**26, 2**28)
        launch(measure_links, ranks, str(links), sizes, backend="nccl" if dev.type == "cuda" else "gloo")
        profile.rates.update(json.loads(links.read_text()))
        links.unlink()
        logger.info(f"links: all-reduce {profile.rates['intra_node_bandwidth'] / 1e9:.0f} GB/s bus bandwidth, "
             f"point-to-point {profile.rates['p2p_bandwidth'] / 1e9:.0f} GB/s")
    profile.save(out)
    logger.info(f"wrote {out}")
    return profile
