"""The training driver: every rank runs ``train_rank`` (SPMD) and walks the same global order.

Per iteration, for each call of the graph in order: reallocate the call's model to the call's
layout, move the call's inputs to its data-parallel replicas, run it, keep its outputs where they
were produced. Ranks outside a call go on to the next call, so calls on disjoint devices overlap.
At the end of the iteration every rank shares a small report (times, losses, per-sequence
rollout facts) with every other; rank 0 logs it, and every rank updates the adaptive KL
coefficient from the same numbers.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from shardflow.data.prompts import PromptSampler, load_prompts
from shardflow.engine.adaptive.generator import AdaptiveGenerator
from shardflow.engine.adaptive.trace import GenerationTrace, plot_trace
from shardflow.engine.generate.engine import Engine
from shardflow.engine.train.optimizer import OptimConfig as EngineOptim
from shardflow.models.checkpoint import save_checkpoint
from shardflow.parallel.world import World
from shardflow.rl.advantages import KLController
from shardflow.rl.graph import Kind
from shardflow.rl.rewards import reward_function
from shardflow.runtime import checkpointing
from shardflow.runtime.adaptive import adaptive_generator
from shardflow.runtime.calls import (
    CallReport,
    Held,
    communication_groups,
    engine_config,
    is_holder,
    join,
    push_outputs,
    rollout_lists,
    run_generate,
    run_generate_adaptive,
    run_inference,
    run_reward_function,
    run_train,
)
from shardflow.runtime.metrics import MetricsLogger, format_line
from shardflow.runtime.models import ModelSlot
from shardflow.runtime.pictures import draw_generation, draw_timeline
from shardflow.runtime.report import merge_reports
from shardflow.runtime.validate import Prepared


def engine_optim(config, role: str, updates: int):
    o = config.models[role].optim
    return EngineOptim(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                       max_grad_norm=o.grad_clip or None, schedule=o.schedule, warmup_steps=o.warmup_steps,
                       total_steps=updates if o.schedule != "constant" else None, min_lr_ratio=o.min_lr_ratio)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class Run:
    """One rank's view of a training run."""

    def __init__(self, world: World, prepared: Prepared):
        self.world, self.prepared = world, prepared
        self.config, self.graph, self.plan = prepared.config, prepared.graph, prepared.plan
        config = self.config
        self.out_dir = config.run.output_dir
        seed_everything(config.run.seed + world.rank)
        world.create_groups(self.plan.layouts())
        world.groups.create(communication_groups(self.graph, self.plan))

        self.tokenizer = AutoTokenizer.from_pretrained(config.models["actor"].path)
        self.prompts = load_prompts(config.data, self.tokenizer, require_answer=config.reward.kind != "model")
        self.sampler = PromptSampler(len(self.prompts), config.algorithm.batch_size, seed=config.run.seed,
                                     shuffle=config.data.shuffle)
        self.reward_fn = reward_function(config.reward) if config.reward.kind != "model" else None
        self.kl = KLController.from_config(config.algorithm)
        self.start_iteration = 0

        resume_dir = checkpointing.latest(self.out_dir) if config.run.resume else None
        updates = config.run.iterations * config.algorithm.epochs * config.algorithm.mini_batches
        self.slots: dict[str, ModelSlot] = {}
        for role in self.graph.models():
            train = self.graph.train_call(role)
            home = self.plan[(train or next(c for c in self.graph.model_calls() if c.model == role)).name].layout
            spec = config.models[role]
            if resume_dir is not None and train is not None:
                spec = type(spec)(**{**asdict(spec), "optim": spec.optim, "path": str(resume_dir / role)})
            optim = engine_optim(config, role, updates) if train is not None else None
            self.slots[role] = ModelSlot.load(world, role, spec, prepared.models[role], home, optim=optim)
        self.engines: dict[str, Engine] = {}
        self.generators: dict[str, AdaptiveGenerator] = {}  # adaptive TP, kept across iterations
        self._predictor_states: dict[str, dict] = {}  # restored, applied when a generator is built
        if resume_dir is not None:
            self._restore(resume_dir)

    # ----- one iteration -------------------------------------------------------------------------

    def iteration(self, it: int) -> dict:
        world, config = self.world, self.config
        prompts = [self.prompts[i] for i in self.sampler.next_batch()]
        held: dict[str, Held] = {}
        inbox: dict[str, list] = {c.name: [] for c in self.graph.model_calls()}
        reports: dict[str, CallReport] = {}
        for call in self.graph.order:
            report = reports.setdefault(call.name, CallReport())
            start = time.time()
            if call.kind is Kind.FUNCTION:
                source = held[call.inputs[0]]
                out = run_reward_function(source.batch, self.tokenizer, self.reward_fn, report)
                layout = source.layout
            else:
                layout = self.plan[call.name].layout
                slot = self.slots[call.model]
                model = slot.model_for(layout)
                report.metrics[f"time/realloc/{call.name}"] = slot.last_move.seconds
                report.metrics[f"realloc/{call.name}/bytes"] = float(slot.last_move.bytes_moved)
                batch = join(inbox.pop(call.name)) if world.rank in layout and call.inputs != ("prompts",) else None
                out = None
                if call.kind is Kind.GENERATE:
                    if model is not None and config.generation.adaptive_tp:
                        generator = self._generator(call.name, model, layout, len(prompts))
                        out = run_generate_adaptive(world, config, generator, layout, prompts, it, report)
                    elif model is not None:
                        engine = self._engine(call.name, model, layout, len(prompts))
                        out = run_generate(world, config, engine, layout, prompts, it, report)
                elif call.kind is Kind.INFERENCE:
                    out = run_inference(world, config, call, model, layout, batch, self.plan[call.name].micro_batches)
                else:
                    engine = slot.engine if world.rank in layout else None
                    run_train(world, config, call, engine, layout, batch, self.kl.value, report,
                              self.plan[call.name].micro_batches)
                slot.done_with(layout)
            if world.rank in layout:
                report.span = (start, time.time())
            for key in call.outputs:
                held[key] = Held(layout, out if is_holder(layout, world.rank) else None)
            push_outputs(world, self.graph, self.plan, call, layout, out, inbox)
            if call.outputs and call.outputs[0] == "rewards" and out is not None:
                report.rollout["reward"] = out.seq_fields["rewards"].tolist()
            if call.kind is Kind.GENERATE and out is not None:
                report.rollout.update(rollout_lists(out))

        # Every rank shares its reports; all compute the same summary.
        gathered: list = [None] * world.size
        dist.all_gather_object(gathered, {name: r for name, r in reports.items()})
        summary = merge_reports(gathered, self.graph, self.plan, config)
        if "actor/kl" in summary:
            self.kl.update(summary["actor/kl"], len(prompts) * config.generation.samples_per_prompt)
        summary["kl_coef"] = self.kl.value
        return summary

    def _engine(self, name: str, model, layout, num_prompts: int) -> Engine:
        engine = self.engines.get(name)
        if engine is None or engine.model is not model:
            engine = Engine(model, engine_config(self.config, layout, num_prompts, self.world.device),
                            eos_token_ids=self._eos_ids())
            engine.release_cache()
            self.engines[name] = engine
        return engine

    def _generator(self, name: str, model, layout, num_prompts: int) -> AdaptiveGenerator:
        """The call's adaptive generator (the plan's tp_targets), built once; collective over the layout."""
        generator = self.generators.get(name)
        if generator is None or generator.models[layout] is not model:
            generator = adaptive_generator(self.world, model, self.plan[name], self.config.generation,
                                           engine_config=engine_config(self.config, layout, num_prompts,
                                                                       self.world.device),
                                           eos_token_ids=self._eos_ids(), call_name=name)
            generator.release()
            if name in self._predictor_states and generator.predictor is None:
                generator.restore_predictor(self._predictor_states[name])
            self.generators[name] = generator
        return generator

    def _eos_ids(self) -> list[int]:
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return eos + list(self.prepared.models["actor"].eos_token_ids)

    # ----- checkpoints -----------------------------------------------------------------------------

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
        state = {role: slot.engine.state_dict() for role, slot in self.slots.items() if slot.engine is not None}
        predictors = {name: g.predictor.state_dict() for name, g in self.generators.items() if g.predictor is not None}
        torch.save({"engines": state, "rng": torch.get_rng_state(), "np_rng": np.random.get_state(),
                    "py_rng": random.getstate(), "length_predictors": predictors},
                   staging / f"rank{world.rank:05d}.pt")
        if world.rank == 0:
            (staging / "state.json").write_text(json.dumps({
                "iteration": it, "sampler": self.sampler.state_dict(), "kl": self.kl.state_dict()}, indent=2))
        world.barrier()
        if world.rank == 0:
            checkpointing.commit(self.out_dir, it, self.config.run.keep_checkpoints)
        world.barrier()

    def _restore(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        self.start_iteration = int(state["iteration"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl.load_state_dict(state["kl"])
        mine = torch.load(path / f"rank{self.world.rank:05d}.pt", weights_only=False)
        for role, engine_state in mine["engines"].items():
            self.slots[role].engine.load_state_dict(engine_state)
        self._predictor_states = mine.get("length_predictors", {})
        torch.set_rng_state(mine["rng"])
        np.random.set_state(mine["np_rng"])
        random.setstate(mine["py_rng"])


def train_rank(world: World, prepared: Prepared) -> None:
    run = Run(world, prepared)
    config = run.config
    logger = None
    if world.rank == 0:
        resume = run.start_iteration if run.start_iteration else None
        logger = MetricsLogger(run.out_dir, tensorboard=config.run.tensorboard, console=None, resume_step=resume)
        (run.out_dir / "plan.yaml").write_text(run.plan.to_yaml())
    iterations = range(run.start_iteration + 1, config.run.iterations + 1)
    bar = tqdm(iterations, desc="iterations", disable=world.rank != 0 or not config.run.progress, dynamic_ncols=True)
    last = None
    for it in bar:
        summary = run.iteration(it)
        last = summary
        if logger is not None:
            flat = logger.log(it, {k: v for k, v in summary.items() if not k.startswith("_")})
            bar.write(format_line(it, flat))
        if config.run.checkpoints and config.run.save_every and it % config.run.save_every == 0 \
                and it != config.run.iterations:
            run.save(it)
    if config.run.checkpoints and run.start_iteration < config.run.iterations:
        run.save(config.run.iterations)
    if logger is not None:
        logger.close()
        if last is not None:
            draw_timeline(last["_spans"], run.out_dir / "timeline.png")
            draw_generation(last["_decode"], run.out_dir / "generation.png")
            for name, trace in last.get("_adaptive", {}).items():
                plot_trace(GenerationTrace.from_dict(trace), run.out_dir / f"generation_{name}_adaptive.png",
                           f"{name}: active batch and layout per decode step (last iteration)")
