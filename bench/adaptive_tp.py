"""Adaptive tensor parallelism against static layouts on a long-tailed generation.

    python bench/adaptive_tp.py --out runs/bench-adaptive          # GPUs (see below)
    python bench/adaptive_tp.py --out runs/bench-adaptive --tiny   # any machine: tiny model, short lengths
    python bench/adaptive_tp.py --out runs/bench-adaptive --tiny --one-device   # the one-GPU path on CPU
    python bench/adaptive_tp.py --out runs/bench-adaptive --roofline   # no device: the roofline's expectation

Workload: 128 prompts of 256 random tokens with forced output lengths (EOS ignored) drawn from a
lognormal with median 2048 and 10% above 8192, capped at 16384; LLaMA-3.1-8B-shaped random bf16
weights; greedy. The length predictor starts from two earlier "iterations" of the same
distribution (other seeds), as in the middle of a run. The policy sees each request's
max_new_tokens only through the batch's largest one (its length limit).

With two GPUs (measured): decode step times per (batch, context) for tp=1 and tp=2 (NCCL), which
feed the policy; then, all in one run, static d2t1, static d1t2, adaptive (d2t1 -> d1t2 when the
policy predicts it pays), and forced switches at several steps (the best of them, or never switching,
is the hindsight optimum), with each switch's cost by part.
With one GPU (partly simulated): decode step times for tp=1 and for a tp=2 shard without its
collectives (measured), the collectives modelled (NVLink latency and bandwidth), and every
strategy simulated on the forced-length timeline from those step times; the switch costs are
estimated by the cost model, with the CUDA-graph capture time measured.
Every mode also prints the simulated figures, so measured and predicted can be compared.
``--tiny`` runs the two-rank comparison on two CPU processes (gloo) with a tiny model.
Prints a table; writes adaptive_tp.json, adaptive_trace.png (measured runs), adaptive_trace_simulated.png
and decode_steps.json (the measured step times, for ``generation.adaptive.step_times``) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardflow.config.experiment import AdaptiveConfig  # noqa: E402
from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.engine.adaptive.generator import AdaptiveGenerator  # noqa: E402
from shardflow.engine.adaptive.length_predictor import LengthPredictor  # noqa: E402
from shardflow.engine.adaptive.reshard import view_model  # noqa: E402
from shardflow.engine.adaptive.simulate import SimRequest, simulate  # noqa: E402
from shardflow.engine.adaptive.switch_cost import CostParams, SwitchCostModel  # noqa: E402
from shardflow.engine.adaptive.switch_policy import Decider  # noqa: E402
from shardflow.engine.adaptive.trace import GenerationTrace, SwitchRecord, plot_trace  # noqa: E402
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.replicas import generate_replicated  # noqa: E402
from shardflow.engine.generate.requests import Request, SamplingParams, make_requests  # noqa: E402
from shardflow.models.transformer import build_model  # noqa: E402
from shardflow.parallel import comm  # noqa: E402
from shardflow.parallel.launch import launch  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402
from shardflow.parallel.world import World  # noqa: E402
from shardflow.perf.hardware import Cluster  # noqa: E402
from shardflow.perf.step_time import StepTable, TableStepTime, roofline_steps  # noqa: E402

LLAMA = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, max_position_embeddings=131072, rope_theta=500000.0)
SHAPES = {
    "8b": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024),
}
# (prompts, prompt tokens, median length, 10% above, cap, step-table batches, contexts, timed steps)
WORKLOADS = {"8b": (128, 256, 2048, 8192, 16384, (1, 4, 16, 32, 64), (1024, 4096, 8192), 12),
             "tiny": (32, 16, 48, 160, 320, (1, 4, 16), (32, 128, 320), 6)}
START, TARGET = Layout.parse("d2p1t1@0-1"), Layout.parse("d1p1t2@0-1")


def forced_lengths(n: int, seed: int, median: float, over: float, cap: int) -> list[int]:
    """Lognormal lengths with the given median and 10% above ``over``, in [16, cap]."""
    sigma = np.log(over / median) / 1.2815515655446004  # the 90th percentile of a standard normal
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 16, cap).astype(int).tolist()


@torch.no_grad()
def random_shard(cfg: ModelConfig, layout: Layout, rank: int, group, device, dtype, seed: int = 0):
    shard = shard_for(cfg, layout, rank)
    model = build_model(cfg, shard, group, device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_steps(engine: GenerationEngine, batches, contexts, steps: int) -> StepTable:
    """Median seconds per decode step at each (batch, context). Requests are adopted with
    ``context`` positions already cached (whatever the cache holds: the time does not depend on
    the values), so long contexts need no prefill."""
    rows = []
    for batch in batches:
        row = []
        for context in contexts:
            params = SamplingParams(max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            requests = [Request(request_id=i, group=i, prompt_ids=[3] * context, params=params, seed=0,
                                output_ids=[5], output_logprobs=[0.0], slot=i, cached_len=context)
                        for i in range(batch)]
            engine.adopt(requests)
            engine.warm_graphs(batch, ["greedy"])
            before = len(engine.stats.decode_steps)
            for _ in range(steps + 2):
                engine.step()
            row.append(statistics.median(s for _, s in engine.stats.decode_steps[before + 2:]))
            engine.detach()
        rows.append(tuple(row))
    return StepTable(tuple(float(b) for b in batches), tuple(float(c) for c in contexts), tuple(rows))


def measure_prefill(engine: GenerationEngine, prompts: int, tokens: int) -> float:
    """Seconds per token of prefilling ``prompts`` prompts of ``tokens`` tokens (second of two runs)."""
    seconds = 0.0
    for i in range(2):
        requests = make_requests([[3 + i + p] * tokens for p in range(prompts)],
                                 SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        engine.submit(requests)
        sync(engine.device)
        start = time.perf_counter()
        engine.prefill_waiting()  # one token each: they end at once and free their slots
        sync(engine.device)
        seconds = time.perf_counter() - start
    return seconds / (prompts * tokens)


def measure_p2p(world: World, nbytes: int) -> float:
    """Bytes per second one way between ranks 0 and 1, both sending at once (as KV migration does)."""
    peer = 1 - world.rank
    buf = torch.empty(nbytes, dtype=torch.uint8, device=world.device)
    for i in range(3):
        sync(world.device)
        start = time.perf_counter()
        comm.exchange([(buf, peer)], [((nbytes,), torch.uint8, world.device, peer)])
        sync(world.device)
        seconds = time.perf_counter() - start
    return nbytes / seconds


def graph_capture_seconds(engine: GenerationEngine, batch: int) -> float:
    if not engine.use_graphs:
        return 0.0
    sync(engine.device)
    start = time.perf_counter()
    engine.decode.capture(engine.decode.bucket(batch), ("sample", False))
    sync(engine.device)
    return time.perf_counter() - start


def simulated(cfg, lengths, history, prompt: int, steps_model, costs, slots: int, interval: int) -> dict:
    """Every strategy on the forced-length timeline, from ``steps_model`` (all simulated)."""
    requests = [SimRequest(prompt, n) for n in lengths]
    predictor = LengthPredictor(max_len=max(lengths))
    for past in history:
        predictor.observe(past)
    decider = Decider(cfg=cfg, chain=[START, TARGET], steps=steps_model, costs=costs, predictor=predictor,
                      config=AdaptiveConfig(interval=interval))
    out = {"static d2t1": simulate(requests, [START], slots=slots, steps=steps_model, costs=costs),
           "static d1t2": simulate(requests, [TARGET], slots=2 * slots + 1, steps=steps_model, costs=costs),
           "adaptive": simulate(requests, [START, TARGET], slots=slots, steps=steps_model, costs=costs,
                                decider=decider, interval=interval)}
    sweep = {s: simulate(requests, [START, TARGET], slots=slots, steps=steps_model, costs=costs,
                         schedule={s: TARGET}, interval=interval) for s in range(0, max(lengths), 8 * interval)}
    sweep[None] = out["static d2t1"]  # never switching is a choice too
    best = min(sweep, key=lambda s: sweep[s].seconds)
    out["hindsight"] = sweep[best]
    result = {name: dict(seconds=r.seconds, decode_steps=r.steps, switches=r.switches) for name, r in out.items()}
    result["hindsight"]["switch_step"] = best
    marks = [SwitchRecord(step=w["step"], source=w["source"], target=w["target"], kv_mode=w["kv_mode"],
                          total_s=w["cost_s"]) for w in out["adaptive"].switches if "cost_s" in w]
    result["_adaptive_trace"] = GenerationTrace(layouts=[str(START), str(TARGET)], active=out["adaptive"].active,
                                                layout_index=out["adaptive"].layout_index, switches=marks)
    return result


# ----- the two-rank comparison (two GPUs, or two CPU processes) ---------------------------------------

def compare(world: World, args: dict) -> None:
    cfg = ModelConfig.from_hf_dict(SHAPES[args["shape"]])
    n, prompt, median, over, cap, batches, contexts, timed = WORKLOADS[args["shape"]]
    device, dtype = world.device, torch.bfloat16 if world.device.type == "cuda" else torch.float32
    world.create_groups([START, TARGET])
    model = random_shard(cfg, START, world.rank, world.groups.get(START.tp_group(world.rank)), device, dtype)
    merged = view_model(cfg, model, TARGET, world.rank, world.groups.get(TARGET.tp_group(world.rank)))
    report: dict = dict(mode=args["mode"], shape=args["shape"], dtype=str(dtype), started=time.time())

    def log(text: str) -> None:
        if world.rank == 0:
            print(f"[{time.time() - report['started']:5.0f}s] {text}", flush=True)

    # 1. decode step times: tp=1 on each replica (rank 0's kept), tp=2 over both ranks
    probe = EngineConfig(max_seq_len=max(contexts) + timed + 8, max_batch_size=2 * max(batches))
    tables, prefill = {}, {}
    for tp, m, batch_grid in ((1, model, batches), (2, merged, tuple(batches) + (2 * max(batches),))):
        engine = GenerationEngine(m, probe)
        log(f"measuring decode steps, tp={tp}, batches {batch_grid}, contexts {contexts}")
        tables[tp] = measure_steps(engine, [b for b in batch_grid if b <= engine.cache.num_slots], contexts, timed)
        prefill[tp] = measure_prefill(engine, min(8, engine.cache.num_slots), min(contexts))
        capture = graph_capture_seconds(engine, 1)
        engine.release_cache()
        del engine
    steps_model = TableStepTime(tables, roofline_steps(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size()),
                                prefill_per_token=prefill)
    if world.rank == 0:
        steps_model.save(Path(args["out"]) / "decode_steps.json")  # for generation.adaptive.step_times
    p2p = measure_p2p(world, (1 << 30) if device.type == "cuda" else (16 << 20))
    log(f"point-to-point {p2p / 1e9:.1f} GB/s one way, both ways at once")
    cluster = Cluster(p2p_bandwidth=p2p)
    costs = SwitchCostModel(cfg, steps_model, cluster, CostParams(graph_capture_s=capture))

    # 2. the generations, all on the same requests
    lengths = forced_lengths(n, 1, median, over, cap)
    history = [forced_lengths(n, seed, median, over, cap) for seed in (2, 3)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size // 2, (prompt,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths]
    config = EngineConfig(max_seq_len=prompt + cap + 1, max_batch_size=n)
    runs: dict = {}

    def timed_run(name: str, fn):
        sync(device)
        world.barrier()
        start = time.perf_counter()
        done = fn(make_requests(prompts, params))
        sync(device)
        seconds = time.perf_counter() - start
        if done is not None:
            assert [len(r.output_ids) for r in done] == lengths, f"{name}: output lengths differ from the forced ones"
            runs[name] = dict(seconds=seconds, tokens_per_s=sum(lengths) / seconds)
            log(f"{name}: {seconds:.2f}s")
        return done

    # Decode graphs of every batch size are captured before timing, as in steady state: engines
    # (and the generator's graphs) are reused across RL iterations. The first capture's cost is
    # reported apart (graph_capture_s per graph).
    for name, layout, m in (("static d2t1", START, model), ("static d1t2", TARGET, merged)):
        engine = GenerationEngine(m, config)
        engine.warm_graphs(engine.cache.num_slots, ["greedy"])
        timed_run(name, lambda reqs: generate_replicated(engine, layout, world, reqs))
        engine.release_cache()
        del engine
    generator = AdaptiveGenerator(world, model, [TARGET], engine_config=config, steps=steps_model, cluster=cluster,
                                  config=AdaptiveConfig(interval=args["interval"]),
                                  cost_params=CostParams(graph_capture_s=capture))
    for engine in generator.engines.values():
        engine.warm_graphs(engine.cache.num_slots, ["greedy"])
    if world.rank == 0:
        generator.predictor = LengthPredictor(max_len=cap)
        for past in history:
            generator.predictor.observe(past)
    timed_run("adaptive", generator.generate)
    trace = generator.last_trace
    adaptive_steps = [s.step for s in trace.switches] if world.rank == 0 else []
    if world.rank == 0:
        runs["adaptive"]["switches"] = [vars(s) for s in trace.switches]
        runs["adaptive"]["refusals"] = [vars(r) for r in trace.refusals]
        runs["adaptive"]["decision_seconds"] = trace.decision_seconds
        plot_trace(trace, Path(args["out"]) / "adaptive_trace.png",
                   f"adaptive d2t1 -> d1t2, {n} prompts (measured, {args['mode']})")
        report["adaptive_trace"] = dict(active=trace.active, layout_index=trace.layout_index)

    # 3. forced switches: candidates where the batch has shrunk to a given size, and the policy's own step
    candidates = _switch_candidates(trace.active if world.rank == 0 else [], adaptive_steps, args["hindsight_points"])
    candidates = _broadcast_list(world, candidates)
    forced = {}
    for step in candidates:
        done = timed_run(f"forced at step {step}",
                         lambda reqs: generator.generate(reqs, schedule={step: (TARGET, "auto")}))
        if done is not None:
            forced[step] = runs.pop(f"forced at step {step}")
            forced[step]["switches"] = [vars(s) for s in generator.last_trace.switches]
    if world.rank != 0:
        return
    runs["forced"] = {str(s): v["seconds"] for s, v in forced.items()}
    forced[None] = runs["static d2t1"]  # never switching is a choice too
    best = min(forced, key=lambda s: forced[s]["seconds"])
    runs["hindsight"] = dict(forced[best], switch_step=best)

    # 4. the same strategies simulated from the measured step times (a check on the model)
    slots = generator.engines[START].cache.num_slots
    sim = simulated(cfg, lengths, history, prompt, steps_model, costs, slots, args["interval"])
    plot_trace(sim.pop("_adaptive_trace"), Path(args["out"]) / "adaptive_trace_simulated.png",
               "adaptive d2t1 -> d1t2 (simulated from measured step times)")
    report.update(step_tables={str(tp): vars(t) for tp, t in tables.items()}, tables_include_comm=True,
                  prefill_s_per_token={str(tp): v for tp, v in prefill.items()}, p2p_gb_per_s=p2p / 1e9,
                  graph_capture_s=capture, workload=_workload(lengths, history, prompt), measured=runs,
                  simulated=sim, kv_slots_per_rank_d2t1=slots)
    finish(report, Path(args["out"]))


def _switch_candidates(active: list[int], policy_steps: list[int], points: int) -> list[int]:
    """Steps where the total active batch first drops to 1/2, 1/4, ... of its start, plus the policy's."""
    if not active:
        return []
    steps, size = [], active[0]
    while len(steps) < points and size >= 1:
        size //= 2
        hit = next((i for i, a in enumerate(active) if a <= max(size, 1)), None)
        if hit is not None and hit not in steps:
            steps.append(hit)
    return sorted(set(steps + policy_steps))


def _broadcast_list(world: World, values: list[int]) -> list[int]:
    box = [values]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _slots(model, config: EngineConfig) -> int:
    """KV slots the engine's default budget gives one rank for the tp=1 layout."""
    engine = GenerationEngine(model, config)
    slots = engine.cache.num_slots
    engine.release_cache()
    return slots


def _workload(lengths, history, prompt) -> dict:
    a = np.array(lengths)
    return dict(prompts=len(lengths), prompt_tokens=prompt, median=float(np.median(a)), mean=float(a.mean()),
                frac_over_8k=float((a > 8192).mean()), max=int(a.max()), total_tokens=int(a.sum()),
                history_iterations=len(history))


# ----- one GPU: measured step times, simulated timeline ---------------------------------------------

def roofline_only(args: dict) -> None:
    """No device at all: every strategy simulated from the roofline of an H200 (an expectation)."""
    start_time = time.time()
    cfg = ModelConfig.from_hf_dict(SHAPES[args["shape"]])
    n, prompt, median, over, cap, *_ = WORKLOADS[args["shape"]]
    steps_model = roofline_steps(cfg)
    costs = SwitchCostModel(cfg, steps_model)
    lengths = forced_lengths(n, 1, median, over, cap)
    history = [forced_lengths(n, seed, median, over, cap) for seed in (2, 3)]
    # KV slots one H200 holds in d2t1: 90% of 141 GB less the weights, over one slot of prompt + cap tokens
    per_slot = (prompt + cap) * cfg.kv_bytes_per_token(2)
    slots = min(n, int((0.9 * 141e9 - 2 * cfg.num_params()) // per_slot) - 1)
    sim = simulated(cfg, lengths, history, prompt, steps_model, costs, slots, args["interval"])
    plot_trace(sim.pop("_adaptive_trace"), Path(args["out"]) / "adaptive_trace_simulated.png",
               "adaptive d2t1 -> d1t2 (simulated from the H200 roofline)")
    finish(dict(mode=args["mode"], shape=args["shape"], dtype="bfloat16", started=start_time, step_tables=None,
                graph_capture_s=0.0, workload=_workload(lengths, history, prompt), measured=None, simulated=sim,
                kv_slots_per_rank_d2t1=slots), Path(args["out"]))


def single_gpu(args: dict) -> None:
    cfg = ModelConfig.from_hf_dict(SHAPES[args["shape"]])
    n, prompt, median, over, cap, batches, contexts, timed = WORKLOADS[args["shape"]]
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    start_time = time.time()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"one device ({name}): measuring step times and simulating the timeline", flush=True)
    full = random_shard(cfg, Layout((0,)), 0, None, device, dtype)
    half = random_shard(cfg, TARGET, 0, None, device, dtype)  # one tp=2 shard, run without its collectives
    probe = EngineConfig(max_seq_len=max(contexts) + timed + 8, max_batch_size=2 * max(batches))
    tables, prefill = {}, {}
    for tp, m, grid in ((1, full, batches), (2, half, tuple(batches) + (2 * max(batches),))):
        engine = GenerationEngine(m, probe)
        print(f"[{time.time() - start_time:4.0f}s] measuring decode steps tp={tp} (collectives not included)",
              flush=True)
        tables[tp] = measure_steps(engine, [b for b in grid if b <= engine.cache.num_slots], contexts, timed)
        prefill[tp] = measure_prefill(engine, min(8, engine.cache.num_slots), min(contexts))
        capture = graph_capture_seconds(engine, 1)
        engine.release_cache()
        del engine
    del half
    if cuda:
        torch.cuda.empty_cache()  # the shard's memory back to the device, for the cache sizing below
    item = torch.empty((), dtype=dtype).element_size()
    steps_model = TableStepTime(tables, roofline_steps(cfg, dtype_bytes=item), add_comm=True,
                                prefill_per_token=prefill)
    steps_model.save(Path(args["out"]) / "decode_steps.json")  # for generation.adaptive.step_times
    costs = SwitchCostModel(cfg, steps_model, Cluster(), CostParams(graph_capture_s=capture))
    lengths = forced_lengths(n, 1, median, over, cap)
    history = [forced_lengths(n, seed, median, over, cap) for seed in (2, 3)]
    slots = _slots(full, EngineConfig(max_seq_len=prompt + cap + 1, max_batch_size=n))
    sim = simulated(cfg, lengths, history, prompt, steps_model, costs, slots, args["interval"])
    plot_trace(sim.pop("_adaptive_trace"), Path(args["out"]) / "adaptive_trace_simulated.png",
               "adaptive d2t1 -> d1t2 (simulated from one GPU's step times)")
    finish(dict(mode=args["mode"], shape=args["shape"], dtype=str(dtype), started=start_time,
                step_tables={str(tp): vars(t) for tp, t in tables.items()}, tables_include_comm=False,
                prefill_s_per_token={str(tp): v for tp, v in prefill.items()},
                comm_model="roofline: the default cluster's intra-node latency per collective and bus bandwidth",
                graph_capture_s=capture, workload=_workload(lengths, history, prompt), measured=None, simulated=sim,
                kv_slots_per_rank_d2t1=slots), Path(args["out"]))


# ----- report -----------------------------------------------------------------------------------------

def finish(report: dict, out: Path) -> None:
    report["seconds"] = time.time() - report.pop("started")
    measured, sim = report.get("measured"), report["simulated"]
    for label, figures in (("measured", measured), ("simulated", sim)):
        if not figures:
            continue
        best_static = min(figures["static d2t1"]["seconds"], figures["static d1t2"]["seconds"])
        adaptive, hindsight = figures["adaptive"]["seconds"], (figures.get("hindsight") or {}).get("seconds")
        report[f"{label}_targets"] = dict(
            adaptive_faster_than_best_static=1 - adaptive / best_static,
            adaptive_over_hindsight=adaptive / hindsight - 1 if hindsight else None,
            met=bool(adaptive <= 0.8 * best_static and hindsight and adaptive <= 1.05 * hindsight))
    print()
    print(f"mode: {report['mode']}; KV slots per rank in d2t1: {report['kv_slots_per_rank_d2t1']}; "
          f"first capture of a decode graph: {report['graph_capture_s'] * 1e3:.1f} ms")
    print("| strategy | measured s | simulated s | switch step(s) |")
    print("|---|---:|---:|---|")
    for name in ("static d2t1", "static d1t2", "adaptive", "hindsight"):
        m = (measured or {}).get(name) or {}
        s = sim.get(name) or {}
        steps = [w["step"] for w in (m.get("switches") or s.get("switches") or []) if "step" in w]
        if name == "hindsight":
            best = m.get("switch_step", s.get("switch_step")) if m else s.get("switch_step")
            steps = "never" if best is None else best
        print(f"| {name} | {m.get('seconds', float('nan')):.2f} | {s.get('seconds', float('nan')):.2f} | {steps} |")
    for label in ("measured", "simulated"):
        t = report.get(f"{label}_targets")
        if t:
            over = t["adaptive_over_hindsight"]
            print(f"{label}: adaptive {t['adaptive_faster_than_best_static']:+.1%} faster than the best static layout "
                  f"(target >= 20%), {'' if over is None else f'{over:+.1%}'} vs hindsight (target <= 5%)")
    for sw in (measured or {}).get("adaptive", {}).get("switches", []):
        peak = "n/a" if sw["peak_extra_bytes"] is None else f"{sw['peak_extra_bytes'] / 1e6:.0f} MB"
        print(f"switch at step {sw['step']}: {sw['kv_mode']} KV, {sw['requests']} requests, "
              f"weights {sw['weights_s'] * 1e3:.1f} ms, requests {sw['requests_s'] * 1e3:.1f} ms, "
              f"KV {sw['kv_s'] * 1e3:.1f} ms ({sw['kv_bytes'] / 1e6:.0f} MB), groups {sw['groups_s'] * 1e3:.1f} ms, "
              f"graphs {sw['graphs_s'] * 1e3:.1f} ms; extra memory {sw['extra_bytes_bound'] / 1e6:.0f} MB bound, "
              f"{peak} measured")
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive_tp.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / 'adaptive_tp.json'} in {report['seconds']:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for adaptive_tp.json and the pictures")
    parser.add_argument("--tiny", action="store_true", help="tiny model and lengths on two CPU processes")
    parser.add_argument("--interval", type=int, default=None, help="decode steps between decisions")
    parser.add_argument("--hindsight-points", type=int, default=6, help="forced switch steps measured")
    parser.add_argument("--roofline", action="store_true",
                        help="no measurement: simulate every strategy from the roofline of an H200")
    parser.add_argument("--one-device", action="store_true",
                        help="the one-GPU path (step times measured, timeline simulated) even with more devices")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    shape = "tiny" if args.tiny or (gpus == 0 and not args.roofline) else "8b"
    options = dict(out=args.out, shape=shape, interval=args.interval or (32 if shape == "8b" else 8),
                   hindsight_points=args.hindsight_points)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.roofline:
        roofline_only(dict(options, mode="roofline only (H200 rates), simulated timeline"))
    elif args.one_device or (gpus == 1 and not args.tiny):
        single_gpu(dict(options, mode=f"one {'GPU' if gpus else 'CPU'}: measured step times, simulated timeline"))
    elif gpus >= 2 and not args.tiny:
        launch(compare, 2, dict(options, mode="two GPUs, measured"), backend="nccl")
    else:
        launch(compare, 2, dict(options, mode="two CPU processes (gloo), tiny model"), backend="gloo")


if __name__ == "__main__":
    main()
