"""The training driver: every rank runs ``train_rank`` (SPMD) and walks the same global order.

Per iteration, for each call of the graph in order: reallocate the call's model to the call's
layout, run the call's kind (``runtime.calls.CALL_KINDS``) on the inputs that reached this rank,
send its outputs on to the calls that read them. Ranks outside a call go on to the next call, so
calls on disjoint devices overlap. At the end of the iteration every rank shares a small report
(times, losses, per-sequence rollout facts) with every other; rank 0 logs it, and every rank
updates the adaptive KL coefficient from the same numbers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from shardflow.config.experiment import ExperimentConfig, ModelSpec
from shardflow.config.files import read_json
from shardflow.data.batch import SequenceBatch
from shardflow.data.prompts import PromptSampler, completion_batch
from shardflow.engine.adaptive.generator import AdaptiveGenerator
from shardflow.engine.adaptive.trace import GenerationTrace, plot_trace
from shardflow.engine.compile_cache import (
    compile_seconds,
    graph_cache_counts,
    kernel_compile_seconds,
    start_compile_workers,
    use_compile_cache,
)
from shardflow.engine.generate import precompile, precompile_launch
from shardflow.models.checkpoint import save_checkpoint
from shardflow.parallel.world import World
from shardflow.rl.advantages import KLController
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.rewards import reward_function, reward_kind
from shardflow.runtime import checkpointing
from shardflow.runtime.calls import CALL_KINDS
from shardflow.runtime.calls.context import CallContext, CallReport, RunState, Sampling
from shardflow.runtime.calls.data import Held, communication_groups, is_holder, join, push_outputs, source_share
from shardflow.runtime.calls.generate import compile_kernels_ahead, precompile_job
from shardflow.runtime.calls.rollouts import start_workers, uses_workers
from shardflow.runtime.evaluation import evaluate
from shardflow.runtime.loggers import config_sinks
from shardflow.runtime.metrics import MetricsLogger
from shardflow.runtime.models import ModelSlot, compute_dtype
from shardflow.runtime.pictures import draw_generation, draw_timeline
from shardflow.runtime.report import merge_reports
from shardflow.runtime.validate import Prepared

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def model_spec(config: ExperimentConfig, role: str, resume_dir: Path | None, trained: bool) -> ModelSpec:
    """A role's settings as this run loads it: a trained model resumes from its checkpoint, and its
    decaying schedule spans the run's optimizer steps unless the settings name a count."""
    spec = config.models[role]
    if not trained:
        return spec
    optim = spec.optim if spec.optim.total_steps else dataclasses.replace(spec.optim, total_steps=config.total_updates)
    path = str(resume_dir / role) if resume_dir is not None else spec.path
    return dataclasses.replace(spec, path=path, optim=optim)


class Run:
    """One rank's view of a training run."""

    def __init__(self, world: World, prepared: Prepared):
        started = time.time()
        self.world, self.prepared = world, prepared
        self.config, self.graph, self.plan = prepared.config, prepared.graph, prepared.plan
        config = self.config
        self.out_dir = config.run.output_dir
        seed_everything(config.run.seed + world.rank)
        resume_dir = prepared.resume_dir
        specs = {role: model_spec(config, role, resume_dir, self.graph.train_call(role) is not None)
                 for role in self.graph.models()}
        generates = [c for c in self.graph.calls if c.kind is Kind.GENERATE and world.rank in self.plan[c.name].layout]
        if world.device.type == "cuda":  # where torch.compile runs
            use_compile_cache(config.run.compile_cache)
        # the decode steps, compiled in a helper process while this one sets up (none: a waiting helper goes)
        jobs = [precompile_job(config, self.plan[c.name].layout, prepared.models[c.model], world,
                               compute_dtype(specs[c.model], world.device), greedy=c.greedy) for c in generates]
        helper = precompile_launch.start(precompile.merged([j for j in jobs if j]), config.run.compile_cache,
                                         Path(self.out_dir) / "logs" / f"precompile-rank{world.rank}.log")
        if world.device.type == "cuda":
            start_compile_workers()
        world.create_groups(self.plan.layouts())
        world.groups.create(communication_groups(self.graph, self.plan))

        tokenizer = prepared.tokenizer
        self.prompts = prepared.prompts  # the dataset's rows (none when only evaluating)
        self.sampler = PromptSampler(len(self.prompts), config.algorithm.batch_size, seed=config.run.seed,
                                     shuffle=config.data.shuffle) if self.prompts else None
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        scored = (any(c.kind is Kind.FUNCTION for c in self.graph.calls)
                  and reward_kind(config.reward.kind).model is None)
        reward_fn = reward_function(config.reward) if scored else None
        self.state = RunState(tokenizer=tokenizer, eos_token_ids=eos + list(prepared.models["actor"].eos_token_ids),
                              reward_fn=reward_fn, kl=KLController.from_config(config.algorithm.kl),
                              precompile=helper)
        if uses_workers(config) and any(self.plan[c.name].layout.coord(world.rank).tp == 0 for c in generates):
            start_workers(config, self.state.worker_pool(config.rollout.workers))  # a replica's holder
        self.start_iteration = 0

        for call in generates:  # while the models load and compile below
            compile_kernels_ahead(config, self.plan[call.name].layout, prepared.models[call.model], world,
                                  compute_dtype(specs[call.model], world.device), greedy=call.greedy)
        self.slots: dict[str, ModelSlot] = {}
        for role, spec in specs.items():
            home = self.plan[self.graph.home_call(role).name].layout
            self.slots[role] = ModelSlot.load(world, role, spec, prepared.models[role], home,
                                              trained=self.graph.train_call(role) is not None)
        if resume_dir is not None:
            self._restore(resume_dir)
        self.setup_seconds = time.time() - started  # reported with the first iteration

    # ----- one iteration -------------------------------------------------------------------------

    def iteration(self, it: int) -> dict:
        world, config = self.world, self.config
        prompts = [self.prompts[i] for i in self.sampler.next_batch()]
        walk = Walk(held={}, inbox={c.name: [] for c in self.graph.model_calls()}, reports={})
        calls, extra = list(self.graph.order), {}
        if self.prepared.algorithm.online and config.algorithm.dynamic_sampling.enabled:
            phase = sampling_calls(self.graph)
            extra = self._sample_dynamically(it, prompts, phase, walk)
            calls = [c for c in calls if c.name not in phase]
        for call in calls:
            self._run_call(call, it, prompts, walk)

        # Every rank shares its reports; all compute the same summary.
        gathered: list = [None] * world.size
        dist.all_gather_object(gathered, walk.reports)
        summary = merge_reports(gathered, self.graph, self.plan, config)
        summary.update(extra)
        if "actor/sequence_kl" in summary:  # the KL per sample, summed over its response tokens
            self.state.kl.update(summary["actor/sequence_kl"], len(prompts) * config.generation.samples_per_prompt)
        summary["kl_coef"] = self.state.kl.value
        return summary

    def _run_call(self, call: Call, it: int, prompts: list, walk: "Walk", *, round: int = 0,
                  push_to: Sequence[str] | None = None, sampling: Sampling | None = None) -> None:
        """One call on this rank: the model into the call's layout, the call's kind on its inputs,
        its outputs held and sent on (to the calls in ``push_to`` only, if given); ``sampling``:
        a generate call's sampling other than the run's (evaluation)."""
        world = self.world
        kind = CALL_KINDS[call.kind]
        report = walk.reports.setdefault(call.name, CallReport()) if round == 0 else CallReport()
        cuda = world.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(world.device)
        start, compiled, graphs = time.time(), compile_seconds(), graph_cache_counts()
        kernels = kernel_compile_seconds()
        if kind.uses_model:
            layout, slot = self.plan[call.name].layout, self.slots[call.model]
            model = slot.model_for(layout)
            report.metrics[f"time/realloc/{call.name}"] = slot.last_move.seconds
            report.metrics[f"realloc/{call.name}/bytes"] = float(slot.last_move.bytes_moved)
            batch = self._inputs(call, layout, walk.inbox, prompts)
        else:  # where its input is held
            slot = model = None
            layout, batch = walk.held[call.inputs[0]].layout, walk.held[call.inputs[0]].batch
        ctx = CallContext(world=world, config=self.config, algorithm=self.prepared.algorithm, plan=self.plan,
                          call=call, layout=layout, iteration=it, prompts=prompts, state=self.state, report=report,
                          slot=slot, model=model, batch=batch, round=round, sampling=sampling)
        out = kind.run(ctx)
        if slot is not None:
            slot.done_with(layout)
        if world.rank in layout:
            report.span = (start, time.time())
        compiled = compile_seconds() - compiled
        if compiled > 0:  # torch.compile at work inside the call (first use, or a recompile)
            report.metrics[f"time/compile/{call.name}"] = compiled
            hits, misses = (after - before for after, before in zip(graph_cache_counts(), graphs))
            report.metrics[f"compile/{call.name}/graphs_cached"] = float(hits)  # found in the compile cache
            report.metrics[f"compile/{call.name}/graphs_built"] = float(misses)
        kernels = kernel_compile_seconds() - kernels
        if kernels > 0:  # shardflow's Triton kernels compiled at their first launch
            report.metrics[f"time/jit/{call.name}"] = kernels
        if cuda:  # the most device memory that tensors held during the call, on this rank
            report.metrics[f"memory/{call.name}/peak_gb"] = torch.cuda.max_memory_allocated(world.device) / 1e9
        if round > 0:
            walk.reports[call.name].absorb(report)
        for key in call.outputs:
            walk.held[key] = Held(layout, out if is_holder(layout, world.rank) else None)
        push_outputs(world, self.graph, self.plan, call, layout, out, walk.inbox, to=push_to)

    def _sample_dynamically(self, it: int, prompts: list, phase: list[str], walk: "Walk") -> dict[str, float]:
        """DAPO's dynamic sampling: generate and score rounds of prompts until ``batch_size`` groups
        with rewards that are not all equal are in hand (or ``max_rounds`` rounds have run), keep
        those groups' samples on their holders, and send them on to the calls after the phase."""
        config, world = self.config, self.world
        n, want = config.generation.samples_per_prompt, config.algorithm.batch_size
        settings = config.algorithm.dynamic_sampling
        rounds: list[dict[str, Held]] = []
        kept: list[int] = []  # groups (sample id // n) in the order they were found
        generated = 0
        for round in range(settings.max_rounds):
            rows = prompts if round == 0 else [self.prompts[i] for i in self.sampler.next_batch()]
            rounds.append(self._walk_phase(phase, it, rows, walk.reports, round=round).held)
            generated += len(rows)
            kept += informative_groups(world, rounds[-1]["rewards"], n)
            if len(kept) >= want:
                break
        chosen = set(kept[:want]) or {g for g in range(len(prompts))}  # nothing informative: round 0, as is
        for key in {k for held in rounds for k in held}:
            parts = [held[key] for held in rounds]
            batches = [h.batch.select([i for i, s in enumerate(h.batch.sample_ids.tolist()) if s // n in chosen])
                       for h in parts if h.batch is not None]
            walk.held[key] = Held(parts[0].layout, SequenceBatch.concat(batches) if batches else None)
        outside = [c.name for c in self.graph.model_calls() if c.name not in phase]
        for name in phase:
            call = self.graph.call(name)
            held = walk.held[call.outputs[0]]
            push_outputs(world, self.graph, self.plan, call, held.layout, held.batch, walk.inbox, to=outside)
        return {"dynamic_sampling/rounds": float(len(rounds)), "dynamic_sampling/groups": float(generated),
                "dynamic_sampling/kept_groups": float(len(chosen)),
                "dynamic_sampling/dropped_groups": float(generated - len(set(kept)))}

    def _walk_phase(self, phase: Sequence[str], it: int, rows: list, reports: dict[str, CallReport], *,
                    round: int = 0, sampling: Sampling | None = None) -> "Walk":
        """The calls of ``phase`` on ``rows``, their outputs sent only among them."""
        local = Walk(held={}, inbox={name: [] for name in phase}, reports=reports)
        for name in phase:
            self._run_call(self.graph.call(name), it, rows, local, round=round, push_to=phase, sampling=sampling)
        return local

    def evaluate(self, it: int, samples_file: Path | None = None) -> dict[str, float]:
        """The held-out evaluation after iteration ``it`` (0: before training), its responses
        written to ``samples_file`` (default ``out_dir/eval/iter-N.jsonl``); collective."""
        phase, rows = sampling_calls(self.graph), self.prepared.eval_prompts

        def walk(sampling: Sampling):
            local = self._walk_phase(phase, it, rows, {}, sampling=sampling)
            return local.held, local.reports

        return evaluate(self.world, self.config, rows, self.state.tokenizer, walk,
                        samples_file or self.out_dir / "eval" / f"iter-{it}.jsonl")

    def _inputs(self, call, layout, inbox: dict[str, list], rows: list) -> SequenceBatch | None:
        """A model call's inputs on this rank: what reached it from other calls, and its replica's
        share of the data rows when it reads them as sequences (an offline algorithm's
        ``examples``); None outside the layout and for a generate call (it reads the prompts)."""
        if self.world.rank not in layout or call.inputs == ("prompts",):
            return None
        parts = inbox.pop(call.name)
        if any(key in self.graph.sources and key != "prompts" for key in call.inputs):
            parts.append(source_share(completion_batch(rows), layout, self.world.rank))
        return join(parts)

    # ----- checkpoints -----------------------------------------------------------------------------

    def _generators(self) -> dict[str, AdaptiveGenerator]:
        return {name: e for name, e in self.state.engines.items() if isinstance(e, AdaptiveGenerator)}

    def save(self, it: int) -> None:
        world = self.world
        staging = checkpointing.staging_dir(self.out_dir, it)
        if world.rank == 0:
            checkpointing.begin(self.out_dir, it)
        world.barrier()
        for role, slot in self.slots.items():
            if slot.engine is None and self.graph.train_call(role) is None:
                continue
            if world.rank in slot.home:
                save_checkpoint(slot.home_model, slot.cfg, slot.home, world.rank, staging / role,
                                tokenizer_dir=self.config.models["actor"].path)
        for role, slot in self.slots.items():
            if slot.engine is not None:  # the trained models' optimizers, by tensor name (any layout reads them)
                slot.engine.save_state(staging / optimizer_dir(role))
        predictors = {name: g.predictor.state_dict() for name, g in self._generators().items()
                      if g.predictor is not None}
        rank_file = staging / "ranks" / f"rank{world.rank:05d}.json"
        rank_file.parent.mkdir(parents=True, exist_ok=True)
        rank_file.write_text(json.dumps({"rng": rng_state(), "length_predictors": predictors}))
        if world.rank == 0:
            (staging / "state.json").write_text(json.dumps({
                "iteration": it, "sampler": self.sampler.state_dict(), "kl": self.state.kl.state_dict(),
                "world_size": world.size, "format": checkpointing.CHECKPOINT_FORMAT,
                "layouts": {role: str(slot.home) for role, slot in self.slots.items() if slot.engine is not None}},
                indent=2))
        world.barrier()
        if world.rank == 0:
            checkpointing.commit(self.out_dir, it, self.config.run.keep_checkpoints)
        world.barrier()

    def _restore(self, path: Path) -> None:
        """Continue from the checkpoint at ``path``, under this run's plan and device count: each
        trained model's optimizer state is read slice by slice for its home layout now."""
        state = read_json(path / "state.json", "checkpoint state")
        self.start_iteration = int(state["iteration"])
        self.sampler.load_state_dict(state["sampler"])
        self.state.kl.load_state_dict(state["kl"])
        for role, slot in self.slots.items():
            if slot.engine is not None:
                slot.engine.load_state(path / optimizer_dir(role))
        mine = path / "ranks" / f"rank{self.world.rank:05d}.json"
        ranks = json.loads((mine if mine.is_file() else path / "ranks" / "rank00000.json").read_text())
        self.state.predictor_states = ranks.get("length_predictors", {})
        if mine.is_file() and state.get("world_size") == self.world.size:  # the same ranks: their random streams go on
            set_rng_state(ranks["rng"])


def optimizer_dir(role: str) -> str:
    """Where a checkpoint keeps a trained model's optimizer state."""
    return f"{role}-optimizer"


def rng_state() -> dict:
    """This process's random generators' states, as JSON values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "numpy": [name, keys.tolist(), pos, has_gauss, cached], "python": [version, list(internal), gauss]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


@dataclass
class Walk:
    """What one walk over the graph holds on this rank: each key's data, what reached each model
    call, each call's report."""

    held: dict[str, Held]
    inbox: dict[str, list]
    reports: dict[str, CallReport]


def sampling_calls(graph: Graph) -> list[str]:
    """The calls that produce the rewards, and the calls they read from, in the graph's order:
    what dynamic sampling repeats round after round."""
    needed, todo = set(), [graph.producer("rewards")]
    while todo:
        name = todo.pop()
        if name in needed or name == "<data>":
            continue
        needed.add(name)
        todo += graph.dependencies(graph.call(name))
    return [c.name for c in graph.order if c.name in needed]


def informative_groups(world: World, rewards: Held, samples_per_prompt: int) -> list[int]:
    """The groups (sample id // samples per prompt) whose rewards are not all equal, gathered from
    the rewards' holders onto every rank, in increasing order."""
    mine = ([], [])
    if rewards.batch is not None:
        mine = (rewards.batch.sample_ids.tolist(), rewards.batch.seq_fields["rewards"].tolist())
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, mine)
    values: dict[int, set] = {}
    for ids, scores in gathered:
        for sample, score in zip(ids, scores):
            values.setdefault(sample // samples_per_prompt, set()).add(score)
    return sorted(g for g, scores in values.items() if len(scores) > 1)


def eval_rank(world: World, prepared: Prepared, out: Path) -> None:
    """``shardflow eval`` on one rank: the held-out evaluation of the prepared actor; rank 0 writes
    the metrics to ``out`` (JSON) and the responses beside it."""
    run = Run(world, prepared)
    try:
        scores = run.evaluate(0, out.with_suffix(".jsonl"))
    finally:
        run.state.close()
    if world.rank == 0:
        out.write_text(json.dumps({"checkpoint": prepared.config.models["actor"].path, **scores}, indent=2))


def train_rank(world: World, prepared: Prepared) -> None:
    run = Run(world, prepared)
    try:
        _train(run)
    finally:
        run.state.close()


def _train(run: "Run") -> None:
    world = run.world
    config = run.config
    metrics = None
    if world.rank == 0:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        plan_file = run.out_dir / "plan.yaml"
        plan_file.write_text(run.plan.to_yaml())
        # a fresh start (no checkpoint, or run.resume=false) keeps nothing of an earlier run's metrics
        resumed = run.start_iteration > 0
        metrics = MetricsLogger(run.out_dir, tensorboard=config.run.tensorboard, resume_step=run.start_iteration,
                                sinks=config_sinks(config, run.out_dir, plan_file, resume=resumed))
    iterations = range(run.start_iteration + 1, config.run.iterations + 1)
    evaluating = bool(run.prepared.eval_prompts)
    if evaluating and config.eval.at_start and run.start_iteration == 0:
        scores = run.evaluate(0)
        if metrics is not None:
            metrics.log(0, scores)
    bar = tqdm(iterations, desc="iterations", disable=world.rank != 0 or not config.run.progress, dynamic_ncols=True)
    last = None
    for it in bar:
        summary = run.iteration(it)
        if it == run.start_iteration + 1:  # this process's first: what came before it (models loaded, groups)
            summary["time/setup"] = run.setup_seconds
        if evaluating and (it == config.run.iterations or (config.eval.every and it % config.eval.every == 0)):
            summary.update(run.evaluate(it))
        last = summary
        if world.rank == 0:
            for text in summary.get("_errors", []):
                logger.warning(f"iteration {it}: {text}")
        if metrics is not None:
            metrics.log(it, {k: v for k, v in summary.items() if not k.startswith("_")})
        if config.run.checkpoints and config.run.save_every and it % config.run.save_every == 0 \
                and it != config.run.iterations:
            run.save(it)
    if config.run.checkpoints and run.start_iteration < config.run.iterations:
        run.save(config.run.iterations)
    if metrics is not None:
        metrics.close()
        if last is not None:
            draw_timeline(last["_spans"], run.out_dir / "timeline.png")
            draw_generation(last["_decode"], run.out_dir / "generation.png")
            for name, trace in last.get("_adaptive", {}).items():
                plot_trace(GenerationTrace.from_dict(trace), run.out_dir / f"generation_{name}_adaptive.png",
                           f"{name}: active batch and layout per decode step (last iteration)")
