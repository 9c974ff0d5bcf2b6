"""Running one call of the dataflow graph on this rank.

Data keys live where their call produced them: on each DP replica's holder (last stage, tp index
0) of the producer's layout, as a ``Held`` batch. Before a model call, the inputs are
redistributed from their holders to the call's DP replicas (one redistribution per producer
layout, the samples' assignment depending only on the samples, so inputs join by sample id);
after it, the outputs stay on the call's holders.

Every function here is called on every rank, in the run's one global order; a rank outside a
call's layout passes through the collectives it takes part in and returns None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.config.settings import ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.data.prompts import Prompt
from shardflow.engine.adaptive.generator import AdaptiveGenerator
from shardflow.engine.generate.engine import Engine, EngineConfig, GenerationStats
from shardflow.engine.generate.replicas import replica_share
from shardflow.engine.generate.requests import Request, SamplingParams, derive_seed, make_requests, to_sequence_batch
from shardflow.engine.inference import infer
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.redistribute import redistribute, redistribute_groups, source_holders
from shardflow.parallel.world import World
from shardflow.rl.advantages import compute_advantages
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.losses import actor_loss, critic_loss
from shardflow.rl.rewards import score_batch

# Per-token fields an inference call needs from its inputs (everything else stays home): the ids,
# and the response tokens, the only ones whose outputs are read.
INFERENCE_FIELDS = ("input_ids", "loss_mask")


@dataclass
class Held:
    """Where a key's data lives: the producer's layout, and this rank's part if it is a holder."""

    layout: Layout
    batch: SequenceBatch | None


@dataclass
class CallReport:
    """What a call reports from this rank (merged over ranks by the driver)."""

    metrics: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, list] = field(default_factory=dict)  # per-sequence lists from the holders
    decode_steps: list[tuple[int, float]] = field(default_factory=list)
    span: tuple[float, float] | None = None  # wall-clock start and end on this rank
    adaptive: dict | None = None  # an adaptive generation's trace (layout's first rank)


def is_holder(layout: Layout, rank: int) -> bool:
    return rank in source_holders(layout)


def communication_groups(graph: Graph, plan) -> list[tuple[int, ...]]:
    """Process groups the run needs besides the layouts' own: one per (producer, consumer) pair
    that redistributes data, and the advantage exchange's groups inside each train layout."""
    groups: list[tuple[int, ...]] = []
    layout_of = {c.name: plan[c.name].layout for c in graph.model_calls()}
    for call in graph.model_calls():
        for producer in graph.dependencies(call):
            src = _holding_layout(graph, producer, layout_of)
            groups += redistribute_groups(src, layout_of[call.name])
    return groups


def _holding_layout(graph: Graph, name: str, layout_of: dict[str, Layout]) -> Layout:
    """Function calls hold their outputs where their input's producer holds it."""
    call = graph.call(name)
    while call.kind is Kind.FUNCTION:
        call = graph.call(graph.dependencies(call)[0])
    return layout_of[call.name]


# ----- data movement ----------------------------------------------------------------------------


def join(parts: list[SequenceBatch]) -> SequenceBatch:
    """Batches of the same samples (any order) merged field by field, in sample-id order."""
    parts = [p.sorted_by_id() for p in parts]
    first = parts[0]
    for p in parts[1:]:
        if not torch.equal(p.sample_ids.cpu(), first.sample_ids.cpu()):
            raise RuntimeError("inputs of one call hold different samples; the redistribution diverged")
    tokens, seqs, meta = {}, {}, {}
    for p in parts:
        tokens.update(p.token_fields)
        seqs.update(p.seq_fields)
        meta.update(p.meta)
    return SequenceBatch(first.sample_ids, first.lengths, tokens, seqs, meta)


def consumers(graph: Graph, call: Call) -> list[Call]:
    """Model calls reading an output of ``call`` (function calls read at the holders instead)."""
    return [c for c in graph.model_calls() if set(c.inputs) & set(call.outputs)]


def push_outputs(world: World, graph: Graph, plan, call: Call, layout: Layout, out: SequenceBatch | None,
                 inbox: dict[str, list[SequenceBatch]]) -> None:
    """Send a call's outputs from its holders to the replicas of every call that reads them, right
    after it ran: a consumer's ranks receive early and keep the data until their call, so the
    producer's ranks never wait for the consumer's turn (calls on disjoint devices stay overlapped)."""
    for consumer in consumers(graph, call):
        local = None
        if is_holder(layout, world.rank):
            local = out
            if consumer.kind is Kind.INFERENCE:  # all an inference call needs
                local = SequenceBatch(out.sample_ids, out.lengths,
                                      {k: v for k, v in out.token_fields.items() if k in INFERENCE_FIELDS})
        share = redistribute(world, local, layout, plan[consumer.name].layout)
        if share is not None:
            inbox[consumer.name].append(share)


# ----- the calls --------------------------------------------------------------------------------


def generation_requests(config: ExperimentConfig, prompts: list[Prompt], iteration: int) -> list[Request]:
    gen = config.generation
    params = SamplingParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
                            top_p=gen.top_p, seed=derive_seed(config.run.seed, iteration),
                            stop_token_ids=tuple(gen.stop_token_ids), ignore_eos=gen.force_length)
    return make_requests([p.ids for p in prompts], params, gen.samples_per_prompt)


def run_generate(world: World, config: ExperimentConfig, engine: Engine, layout: Layout, prompts: list[Prompt],
                 iteration: int, report: CallReport) -> SequenceBatch | None:
    """Each replica generates its prompts' groups; the holder keeps the rollouts."""
    requests = generation_requests(config, prompts, iteration)
    c = layout.coord(world.rank)
    mine = replica_share(requests, layout.dp, c.dp)
    start = time.perf_counter()
    engine.reset_cache()
    engine.stats = GenerationStats()
    setup = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(mine)
    seconds = time.perf_counter() - start
    engine.release_cache()
    report.decode_steps = list(engine.stats.decode_steps)
    report.metrics.update({"generation/tokens": float(engine.stats.generated_tokens), "generation/seconds": seconds,
                           "generation/setup_seconds": setup,
                           "generation/prefill_seconds": engine.stats.prefill_seconds})
    return rollouts(mine, prompts) if c.tp == 0 else None


def run_generate_adaptive(world: World, config: ExperimentConfig, generator: AdaptiveGenerator, layout: Layout,
                          prompts: list[Prompt], iteration: int, report: CallReport) -> SequenceBatch | None:
    """Like ``run_generate``, with the layout changing mid-decode (adaptive TP). Every request ends
    on ranks that include its starting replica's, so the holders keep the same rollouts; the
    layout's first rank reports the switches and the active batch per step."""
    requests = generation_requests(config, prompts, iteration)
    c = layout.coord(world.rank)
    start = time.perf_counter()
    done = generator.generate(requests)
    seconds = time.perf_counter() - start
    generator.release()  # the KV cache and fused copies make room for the calls that follow
    mine = replica_share(requests, layout.dp, c.dp)
    report.metrics["generation/tokens"] = float(sum(len(r.output_ids) for r in mine))
    report.metrics["generation/seconds"] = seconds
    if done is not None:
        trace = generator.last_trace
        report.decode_steps = list(zip(trace.active, trace.step_seconds))
        report.metrics.update(trace.metrics())
        report.adaptive = trace.to_dict()
    return rollouts(mine, prompts) if c.tp == 0 else None


def rollouts(mine: list[Request], prompts: list[Prompt]) -> SequenceBatch:
    """A replica's finished requests as the batch its holder keeps."""
    batch = to_sequence_batch(mine)
    groups = [r.group for r in mine]
    return batch.update(seq_fields={"prompt_index": torch.tensor([prompts[g].index for g in groups])},
                        meta={"answers": [prompts[g].answer for g in groups]})


def run_reward_function(batch: SequenceBatch | None, tokenizer, fn, report: CallReport) -> SequenceBatch | None:
    """Rule-based rewards, computed where the rollouts are held."""
    if batch is None:
        return None
    rewards = score_batch(batch, tokenizer, fn)
    return SequenceBatch(batch.sample_ids, batch.lengths, {}, {"rewards": rewards})


def run_inference(world: World, config: ExperimentConfig, call: Call, model: Transformer | None, layout: Layout,
                  batch: SequenceBatch | None, micro_batches: int | None = None) -> SequenceBatch | None:
    """Reference log-probs, critic values, or reward-model scores; outputs stay on the holders."""
    if model is None:
        return None
    algo = config.algorithm
    if call.model == "reward":
        # The score of a sequence is the value head after reading its last token; the shifted
        # per-token values put that at one position past the end, so append one pad token.
        pad = torch.zeros(len(batch), dtype=torch.long)
        ids = [torch.cat([t, p[None]]) for t, p in zip(split_tokens(batch, "input_ids"), pad)]
        padded = SequenceBatch.from_lists(batch.sample_ids.tolist(), {"input_ids": ids})
        out = infer(model, layout, world, padded, "values",
                    micro_batch_tokens=token_budget(padded, algo.micro_batch_tokens, micro_batches))
        if out is None or not is_holder(layout, world.rank):
            return None
        last = out.offsets[1:] - 1  # the appended position
        scores = out.token_fields["values"][last.to(out.token_fields["values"].device)].float().cpu()
        return SequenceBatch(batch.sample_ids, batch.lengths, {}, {"rewards": scores})
    what, key = ("values", "values") if call.model == "critic" else ("logprobs", "ref_logprobs")
    out = infer(model, layout, world, batch, what,
                micro_batch_tokens=token_budget(batch, algo.micro_batch_tokens, micro_batches),
                temperature=max(config.generation.temperature, 1e-6) if what == "logprobs" else 1.0,
                outputs_at="loss_mask",  # the losses and advantages read response tokens only
                share_prompts=algo.share_prompts)
    if out is None or not is_holder(layout, world.rank):
        return None
    return SequenceBatch(batch.sample_ids, batch.lengths, {key: out.token_fields[what].float().cpu()})


def token_budget(batch: SequenceBatch, default: int, micro_batches: int | None) -> int:
    """Padded tokens per micro-batch: the plan's micro-batch count when it gives one (about that
    many micro-batches per replica), else the run's budget; never less than the longest sequence."""
    longest = int(batch.lengths.max()) if len(batch) else 1
    if micro_batches is not None:
        return max(longest, -(-batch.num_tokens // micro_batches))
    return max(longest, default)


def run_train(world: World, config: ExperimentConfig, call: Call, engine, layout: Layout,
              batch: SequenceBatch | None, kl_coef: float, report: CallReport,
              micro_batches: int | None = None) -> None:
    """Advantages over the whole batch (exchanged over the replicas), then epochs x mini-batches
    of optimizer steps on this replica's share."""
    if engine is None:
        return
    algo = config.algorithm
    dp_group = world.groups.get(layout.dp_group(world.rank))
    batch = compute_advantages(batch.to("cpu"), algo, kl_coef=kl_coef, group=dp_group)
    if call.model == "actor":
        loss_fn = actor_loss(algo, kl_coef=0.0 if algo.kl_in_reward else kl_coef)
        temperature = max(config.generation.temperature, 1e-6)
    else:
        loss_fn, temperature = critic_loss(algo), 1.0
    order = torch.argsort(batch.sample_ids)
    parts = [order[i::algo.mini_batches] for i in range(algo.mini_batches)]
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(algo.epochs):
        for part in parts:
            if len(part) == 0:
                raise ValueError(f"{call.name}: a replica of {layout} got fewer sequences than "
                                 f"algorithm.mini_batches={algo.mini_batches}")
            mini = batch.select(part)
            budget = token_budget(mini, algo.micro_batch_tokens, micro_batches)
            metrics = engine.step(mini, loss_fn, micro_batch_tokens=budget, temperature=temperature,
                                  share_prompts=algo.share_prompts)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            steps += 1
    prefix = call.model
    report.metrics.update({f"{prefix}/{k}": v / steps for k, v in sums.items()})


def split_tokens(batch: SequenceBatch, key: str) -> list[torch.Tensor]:
    offsets = batch.offsets.tolist()
    values = batch.token_fields[key]
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(batch))]


def rollout_lists(batch: SequenceBatch | None) -> dict[str, list[Any]]:
    """Per-sequence facts of held rollouts for the iteration's metrics."""
    if batch is None:
        return {}
    mask = batch.token_fields["loss_mask"] > 0
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    response = torch.zeros(len(batch), dtype=torch.long).index_add_(0, seq, mask.long())
    return {
        "response_length": response.tolist(),
        "prompt_length": batch.seq_fields["prompt_lengths"].tolist(),
        "finish_reason": list(batch.meta.get("finish_reason", [])),
    }


def engine_config(config: ExperimentConfig, layout: Layout, num_prompts: int, device: torch.device) -> EngineConfig:
    gen = config.generation
    per_replica = -(-num_prompts // layout.dp) * gen.samples_per_prompt
    return EngineConfig(
        max_seq_len=config.data.max_prompt_tokens + gen.max_new_tokens + 1,
        max_batch_size=max(1, per_replica),
        kv_cache_bytes=int(gen.kv_cache_gb * (1 << 30)) or None,
        compile=gen.compile and device.type == "cuda" and layout.tp == 1,
        compile_mode=gen.compile_mode,
        blas_library=(gen.blas_library or None) if device.type == "cuda" else None,
        transposed_weights=gen.transposed_weights and device.type == "cuda",
        share_prompt_kv=gen.share_prompt_kv,
    )
