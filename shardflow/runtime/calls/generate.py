"""The generate call: each replica generates its prompts' groups; the holders keep the rollouts.

With ``generation.adaptive.enabled`` the call's layout changes mid-decode (adaptive TP, toward
the plan's ``tp_targets``); every request ends on ranks that include its starting replica's, so
the holders keep the same rollouts, and the layout's first rank reports the switches and the
active batch per step. Engines and adaptive generators are built once per call and kept across
iterations (their captured graphs and the length predictor carry over).

With ``rollout.env`` every request is a multi-turn episode (``engine.generate.episodes``) whose
environment runs in the holder's worker pool; rewards are scored there too as responses finish
(``runtime.calls.rollouts``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from shardflow.config.experiment import AdaptiveConfig, ExperimentConfig
from shardflow.config.model import ModelConfig
from shardflow.data.batch import SequenceBatch
from shardflow.data.prompts import Prompt
from shardflow.engine.adaptive.generator import AdaptiveGenerator
from shardflow.engine.generate import kernel_warmup, precompile
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine, GenerationStats
from shardflow.engine.generate.episodes import Episodes, run_episodes
from shardflow.engine.generate.replicas import replica_share
from shardflow.engine.generate.requests import Request, SamplingParams, derive_seed, make_requests, to_sequence_batch
from shardflow.engine.generate.sampling import batch_mode
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for
from shardflow.parallel.world import World
from shardflow.perf.step_time import load_step_times
from shardflow.runtime.calls.context import CallContext, Sampling
from shardflow.runtime.calls.rollouts import CallRollouts, episode_output_limit, replica_share_fn, uses_workers


def engine_config(config: ExperimentConfig, layout: Layout, num_prompts: int, device: torch.device) -> EngineConfig:
    """The generation settings as the engine of one replica of ``layout`` takes them: KV slots for
    its share of ``num_prompts`` prompts' samples, and for one prompt's evaluation samples."""
    gen = config.generation
    per_replica = max(-(-num_prompts // layout.dp) * gen.samples_per_prompt,
                      config.eval.samples if config.eval.enabled else 1)
    return EngineConfig(
        max_seq_len=config.data.max_prompt_tokens + episode_output_limit(config) + 1,
        max_batch_size=max(1, per_replica),
        kv_cache_bytes=int(gen.kv_cache_gb * (1 << 30)) or None,
        compile=gen.compile and device.type == "cuda" and layout.tp == 1,
        compile_mode=gen.compile_mode,
        combo_kernels=gen.combo_kernels,
        blas_library=(gen.blas_library or None) if device.type == "cuda" else None,
        transposed_weights=gen.transposed_weights and device.type == "cuda",
        share_prompt_kv=gen.share_prompt_kv,
        kv_block_size=gen.kv_block_size or None,
    )


def compile_kernels_ahead(config: ExperimentConfig, layout: Layout, cfg: ModelConfig, world: World,
                          dtype: torch.dtype, *, greedy: bool) -> None:
    """Start compiling, in the background, the Triton kernels that this rank's first decode step
    of a generate call in ``layout`` (``greedy``: the call's ``greedy``) will launch
    (``engine.generate.kernel_warmup``), while the run sets up; its engine is built from the same
    settings at the call's first run."""
    gen = config.generation
    kernel_warmup.start(world.device, dtype, cfg, shard_for(cfg, layout, world.rank),
                        engine_config(config, layout, config.algorithm.batch_size, world.device),
                        mode=batch_mode([0.0 if greedy else gen.temperature], [gen.top_k], [gen.top_p]),
                        shared_prompts=gen.samples_per_prompt > 1)


def precompile_job(config: ExperimentConfig, layout: Layout, cfg: ModelConfig, world: World, dtype: torch.dtype, *,
                   greedy: bool) -> precompile.Job | None:
    """The decode steps that this rank's first generate call in ``layout`` (``greedy``: the call's
    ``greedy``) compiles, for a helper process to compile ahead (``engine.generate.precompile``);
    None where none does: ``generation.compile_ahead`` off, an engine that does not compile (CPU,
    tp > 1), or a rank other than the layout's first (its ranks compile the same steps into the
    machine's one cache)."""
    gen = config.generation
    engine = engine_config(config, layout, config.algorithm.batch_size, world.device)
    if not (gen.compile_ahead and engine.compile and world.rank == layout.ranks[0]):
        return None
    return precompile.Job(cfg=cfg, shard=shard_for(cfg, layout, world.rank), engine=engine, device=str(world.device),
                          dtype=dtype, batch=-(-config.algorithm.batch_size // layout.dp) * gen.samples_per_prompt,
                          modes=(batch_mode([0.0 if greedy else gen.temperature], [gen.top_k], [gen.top_p]),),
                          shared=gen.samples_per_prompt > 1, varying=not gen.force_length)


def generation_requests(config: ExperimentConfig, prompts: list[Prompt], iteration: int, *,
                        greedy: bool = False, round: int = 0, sampling: Sampling | None = None) -> list[Request]:
    """The requests of one generate call: the same ids for every call of an iteration, so that a
    greedy baseline's responses join the sampled ones sample by sample; a later generation round
    (dynamic sampling) draws from its own seed; ``sampling`` overrides the run's settings."""
    gen = config.generation
    seed = derive_seed(config.run.seed, iteration) if round == 0 else derive_seed(config.run.seed, iteration, round)
    samples, temperature, max_new = gen.samples_per_prompt, gen.temperature, gen.max_new_tokens
    if sampling is not None:
        samples, temperature, max_new = sampling.samples_per_prompt, sampling.temperature, sampling.max_new_tokens
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else temperature,
                            top_k=gen.top_k, top_p=gen.top_p, seed=seed,
                            stop_token_ids=tuple(gen.stop_token_ids), ignore_eos=gen.force_length)
    return make_requests([p.ids for p in prompts], params, samples)


def run_generate(ctx: CallContext) -> SequenceBatch | None:
    if ctx.model is None:
        return None
    adaptive = ctx.config.generation.adaptive.enabled
    out = (_generate_adaptive if adaptive else _generate)(ctx, _engine(ctx, adaptive))
    if ctx.state.precompile is not None:  # its time was this call: its device memory goes before training's
        ctx.state.precompile.finish()
        ctx.state.precompile = None
    if out is not None and ctx.call.outputs == ("responses",):  # the rollouts' facts, not a baseline's
        ctx.report.rollout.update(rollout_lists(out))
    return out


def _engine(ctx: CallContext, adaptive: bool) -> Any:
    """The call's engine (or adaptive generator), built on first use and whenever its model changed;
    collective over the layout."""
    engines, name, model = ctx.state.engines, ctx.call.name, ctx.model
    engine = engines.get(name)
    current = engine.models[ctx.layout] if isinstance(engine, AdaptiveGenerator) else getattr(engine, "model", None)
    if engine is not None and current is model:
        return engine
    if ctx.state.precompile is not None:  # the first steps' graphs in the cache: the engine finds them
        ctx.report.metrics[f"time/precompile_wait/{ctx.call.name}"] = ctx.state.precompile.wait_ready()
    config = engine_config(ctx.config, ctx.layout, ctx.config.algorithm.batch_size, ctx.world.device)
    if adaptive:
        engine = adaptive_generator(ctx.world, model, ctx.plan[name].tp_targets, ctx.config.generation.adaptive,
                                    engine_config=config, eos_token_ids=ctx.state.eos_token_ids)
        engine.release()
        if name in ctx.state.predictor_states and engine.predictor is None:
            engine.restore_predictor(ctx.state.predictor_states[name])
    else:
        engine = GenerationEngine(model, config, eos_token_ids=ctx.state.eos_token_ids)
        engine.release_cache()
    engines[name] = engine
    return engine


def adaptive_generator(world: World, model: Transformer, targets: Sequence[Layout], settings: AdaptiveConfig, *,
                       engine_config: EngineConfig, eos_token_ids: Sequence[int] = ()) -> AdaptiveGenerator:
    """The adaptive generator of a generate call: ``model`` in the plan's layout, switching to the
    plan's ``targets`` as ``settings`` say, its step times from ``settings.step_times`` (the
    roofline when empty). Collective over the layout's ranks."""
    steps, cluster = load_step_times(settings.step_times, model.cfg, next(model.parameters()).element_size())
    return AdaptiveGenerator(world, model, targets, engine_config=engine_config, eos_token_ids=eos_token_ids,
                             config=settings, steps=steps, cluster=cluster)


def _rollouts(ctx: CallContext, max_seq_len: int) -> CallRollouts | None:
    """What runs beside decoding on this rank: on a replica's holder, with a worker pool."""
    config = ctx.config
    if ctx.layout.coord(ctx.world.rank).tp != 0 or not uses_workers(config):
        return None
    pool = ctx.state.worker_pool(config.rollout.workers)
    return CallRollouts(config, pool, ctx.state.tokenizer, ctx.prompts, max_seq_len)


def _generate(ctx: CallContext, engine: GenerationEngine) -> SequenceBatch | None:
    config = ctx.config
    requests = generation_requests(config, ctx.prompts, ctx.iteration, greedy=ctx.call.greedy, round=ctx.round,
                                   sampling=ctx.sampling)
    c = ctx.layout.coord(ctx.world.rank)
    mine = replica_share(requests, ctx.layout.dp, c.dp)
    start = time.perf_counter()
    engine.reset_cache()
    engine.stats = GenerationStats()
    setup = time.perf_counter() - start
    side = _rollouts(ctx, engine.max_seq_len)
    finished = side.finished if side is not None else None
    start = time.perf_counter()
    if config.rollout.env:
        rows = [ctx.prompts[r.group].row for r in mine]
        run_episodes(engine, mine, side.client if side is not None else None, rows,
                     share=replica_share_fn(ctx.world, ctx.layout), max_output=episode_output_limit(config),
                     on_finish=finished, reproducible=config.rollout.reproducible)
    else:
        engine.generate(mine, finished)
    seconds = time.perf_counter() - start
    engine.release_cache()
    report = ctx.report
    report.decode_steps = list(engine.stats.decode_steps)
    report.metrics.update({"generation/tokens": float(engine.stats.generated_tokens), "generation/seconds": seconds,
                           "generation/setup_seconds": setup,
                           "generation/prefill_seconds": engine.stats.prefill_seconds})
    if c.tp != 0:
        return None
    batch = rollouts(mine, ctx.prompts, first_id=sample_offset(ctx))
    return side.attach(batch, mine, report) if side is not None else batch


def _generate_adaptive(ctx: CallContext, generator: AdaptiveGenerator) -> SequenceBatch | None:
    requests = generation_requests(ctx.config, ctx.prompts, ctx.iteration, greedy=ctx.call.greedy, round=ctx.round,
                                   sampling=ctx.sampling)
    c = ctx.layout.coord(ctx.world.rank)
    side = _rollouts(ctx, generator.engines[generator.chain[0]].max_seq_len)
    episodes = None
    if ctx.config.rollout.env:
        episodes = Episodes(side.client if side is not None else None,
                            {r.request_id: ctx.prompts[r.group].row for r in requests},
                            episode_output_limit(ctx.config), ctx.config.rollout.reproducible)
    start = time.perf_counter()
    done = generator.generate(requests, side.finished if side is not None else None, episodes=episodes)
    seconds = time.perf_counter() - start
    generator.release()  # the KV cache and fused copies make room for the calls that follow
    mine = replica_share(requests, ctx.layout.dp, c.dp)
    report = ctx.report
    report.metrics["generation/tokens"] = float(sum(len(r.output_ids) for r in mine))
    report.metrics["generation/seconds"] = seconds
    if done is not None:
        trace = generator.last_trace
        report.decode_steps = list(zip(trace.active, trace.step_seconds))
        report.metrics.update(trace.metrics())
        report.adaptive = trace.to_dict()
    if c.tp != 0:
        return None
    batch = rollouts(mine, ctx.prompts, first_id=sample_offset(ctx))
    return side.attach(batch, mine, report) if side is not None else batch


def sample_offset(ctx: CallContext) -> int:
    """The first sample id of the call's round: the rounds of an iteration number their samples
    apart (a prompt's samples are consecutive, so a sample's group is its id // samples per prompt)."""
    return ctx.round * len(ctx.prompts) * ctx.config.generation.samples_per_prompt


def rollouts(mine: list[Request], prompts: list[Prompt], *, first_id: int = 0) -> SequenceBatch:
    """A replica's finished requests as the batch its holder keeps (sample ids from ``first_id``)."""
    batch = to_sequence_batch(mine)
    groups = [r.group for r in mine]
    batch = SequenceBatch(batch.sample_ids + first_id, batch.lengths, batch.token_fields, batch.seq_fields, batch.meta)
    return batch.update(seq_fields={"prompt_index": torch.tensor([prompts[g].index for g in groups])},
                        meta={"answers": [prompts[g].answer for g in groups]})


def rollout_lists(batch: SequenceBatch) -> dict[str, list[Any]]:
    """Per-sequence facts of held rollouts for the iteration's metrics."""
    mask = batch.token_fields["loss_mask"] > 0
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    response = torch.zeros(len(batch), dtype=torch.long).index_add_(0, seq, mask.long())
    return {
        "response_length": response.tolist(),
        "prompt_length": batch.seq_fields["prompt_lengths"].tolist(),
        "finish_reason": list(batch.meta.get("finish_reason", [])),
    }
