"""Generation that switches layout mid-decode: one engine per layout, every replica in lockstep.

Every rank of the starting layout builds one ``AdaptiveGenerator`` and calls ``generate`` with the
same requests (as with ``generate_replicated``). For each layout of its chain (the start, then the
targets, each a replica merge of the one before) it keeps this rank's model (views of the start
model's tensors, or a reallocated copy where the layouts do not nest) and an engine decoding into
a regrouped view of the start engine's KV cache. Engines, their captured CUDA graphs and the
communication groups (created by the caller up front) persist across ``generate`` calls.

The loop: each replica steps its engine once per iteration, so every rank counts decode steps
alike. Every ``interval`` steps (a decision point) the layout's ranks all-gather a fixed-size
summary of their unfinished requests; the layout's first rank decides (the policy, or a forced
schedule) and broadcasts the decision, so that every rank acts on the same one. A switch runs on
every rank in lockstep: weights (views: nothing to do; otherwise reallocation), the merged
replicas' request states exchanged, their KV migrated or recomputed, the new layout's decode
graphs captured; decoding goes on in the new layout's engine. Generation ends at the first
decision point where no rank has an unfinished request.

Multi-turn episodes (``episodes``): the environments of a replica's episodes live with the
holder of its starting replica for the whole generation; at each decision point the holders'
answers are all-gathered over the layout and applied by whichever ranks hold each episode then.
An episode between turns at a switch travels with its replica's requests, and its KV is
recomputed at its next turn.

Collectives per decision point: one all-gather of [ranks, 3 x buckets + 3] float64 and one
broadcast of two integers, over the layout's ranks (with episodes pending, one all-gather of the
environments' answers too). Per switch: see ``reshard`` and
``kv_migration``. At the end: one gather of results and per-step counts to the first rank.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from shardflow.config.experiment import AdaptiveConfig
from shardflow.engine.adaptive.kv_migration import (
    KV_MODES,
    MIGRATE,
    RECOMPUTE,
    clean_slots,
    fit_problem,
    gather_requests,
    kv_plan,
    migrate,
    regroup_factor,
)
from shardflow.engine.adaptive.length_predictor import LengthPredictor
from shardflow.engine.adaptive.merge import nests, plan_merge
from shardflow.engine.adaptive.reshard import allocated_model, refill, view_model
from shardflow.engine.adaptive.switch_cost import CostParams, SwitchCostModel
from shardflow.engine.adaptive.switch_policy import Decider, Decision, Loads, bucket_edges, bucket_sums
from shardflow.engine.adaptive.trace import GenerationTrace, Refusal, SwitchRecord
from shardflow.engine.generate.decode_weights import make_decode_weights, refresh_decode_weights
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.episodes import Answers, Episodes, Turns, apply_answers, collect_answers
from shardflow.engine.generate.kv_cache import KVCache, bytes_per_position
from shardflow.engine.generate.replicas import fill_results, replica_share, result_states
from shardflow.engine.generate.requests import Request
from shardflow.engine.generate.sampling import batch_mode
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.offload import regrow_storage, release_storage
from shardflow.parallel.sharding import check_layout, shard_for
from shardflow.parallel.world import World
from shardflow.perf.hardware import Cluster
from shardflow.perf.step_time import StepTimeModel, roofline_steps
from shardflow.perf.transfer import received_bytes

logger = logging.getLogger(__name__)

# A forced switch: at decode step s, switch to layout L with KV mode m ("migrate", "recompute" or
# "auto" for the cost model's choice).
Schedule = Mapping[int, tuple[Layout, str]]
BUSY, ACTIVE = 0, 1  # columns of a rank's summary (then the waiting count and the bucket sums)
RUNNABLE, ONLY_PENDING = 1.0, 2.0  # BUSY: decoding to do, or only episodes waiting on their environments


class AdaptiveGenerator:
    def __init__(self, world: World, model: Transformer, targets: Sequence[Layout], *,
                 engine_config: EngineConfig = EngineConfig(), eos_token_ids: Sequence[int] = (),
                 config: AdaptiveConfig = AdaptiveConfig(), steps: StepTimeModel | None = None,
                 cluster: Cluster = Cluster(), cost_params: CostParams = CostParams()):
        """``model``: this rank's model in the starting layout. ``targets``: layouts to switch to,
        in order, each merging replicas of the one before; one that is not is refused (logged,
        listed in ``refused``) and left out. The groups of the start and of every target must
        exist (``world.create_groups``). Collective over the starting layout's ranks."""
        cfg, start, rank = model.cfg, model.shard.layout, world.rank
        if start.pp != 1:
            raise ValueError(f"generation with pipeline parallelism is not supported (layout {start}); use pp=1")
        self.paged = engine_config.kv_block_size is not None
        self.world, self.cfg, self.config = world, cfg, config
        self.device = next(model.parameters()).device
        self.refused: list[Refusal] = []
        chain = [start]
        for target in targets:
            try:
                plan_merge(chain[-1], target)
                check_layout(cfg, target)
            except ValueError as e:
                self._refuse(self.refused, -1, target, str(e))
                continue
            chain.append(target)
        self.chain = chain
        self.group = world.groups.get(start.ranks)  # every rank of the layout
        self.decider_rank = start.ranks[0]
        tp_groups = {layout: world.groups.get(layout.tp_group(rank)) for layout in chain}

        # Models: views where the target nests in the start layout, else storage of their own
        # (allocated before the KV cache takes the free memory).
        self.models: dict[Layout, Transformer] = {start: model}
        self.weight_bytes: dict[Layout, int] = {}  # targets reached by reallocation: bytes the busiest rank receives
        item = next(model.parameters()).element_size()
        for layout in chain[1:]:
            if nests(cfg, start, layout):
                self.models[layout] = view_model(cfg, model, layout, rank, tp_groups[layout])
            else:
                self.models[layout] = allocated_model(cfg, layout, rank, tp_groups[layout], like=model)
                self.weight_bytes[layout] = max(received_bytes(cfg, start, layout, r, item) for r in layout.ranks)

        # Engines: the start engine owns the KV cache; every rank gets the same number of slots
        # (admission decisions depend on it), then each target decodes into a regrouped view. On
        # GPUs every engine decodes with copies of the weights (``make_decode_weights``): the
        # targets' are made first, so that the cache is sized after them.
        self._engine_config = engine_config
        self._fuse_targets()
        first = GenerationEngine(model, engine_config, eos_token_ids=eos_token_ids)
        self.engines: dict[Layout, GenerationEngine] = {start: first}
        self._equal_slots()
        for layout in chain[1:]:
            config_l = dataclasses.replace(engine_config, compile=engine_config.compile and layout.tp == 1)
            self.engines[layout] = GenerationEngine(self.models[layout], config_l, eos_token_ids=eos_token_ids,
                                          cache=first.cache.regroup(self._heads(layout)))

        self.steps = steps or roofline_steps(cfg, cluster, dtype_bytes=item)
        self.costs = SwitchCostModel(cfg, self.steps, cluster,
                                     dataclasses.replace(cost_params, bucket_bytes=config.bucket_bytes),
                                     dtype_bytes=item)
        self.predictor: LengthPredictor | None = None  # on the deciding rank, from the first generation on
        self.last_trace: GenerationTrace | None = None
        self._pointers = self._weight_pointers()

    # ----- generation ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], on_finish: Callable[[Request], None] | None = None, *,
                 schedule: Schedule | None = None, episodes: Episodes | None = None) -> list[Request] | None:
        """Generate ``requests`` (the same list on every rank) starting in the first layout.

        ``schedule``: forced switches instead of the policy (an empty one never switches).
        ``on_finish`` is called on each rank for the requests of its starting replica (episodes:
        once they are over). ``episodes``: run the requests as multi-turn episodes (its ``turns``
        on the holders of the starting replicas). Returns, on the layout's first rank, every
        request finished (sorted by id); None on the others.
        """
        start, rank = self.chain[0], self.world.rank
        engine = self.engines[start]
        for layout_engine in self.engines.values():
            if layout_engine.busy:
                raise RuntimeError("an engine still holds requests from an interrupted generation")
        _check_requests(requests, engine.max_seq_len)
        for step, (target, mode) in (schedule or {}).items():
            if not (isinstance(step, int) and step >= 0 and isinstance(target, Layout)
                    and mode in ("auto", *KV_MODES)):
                raise ValueError(f"a forced switch must be step (>= 0) -> (Layout, 'auto' | 'migrate' | 'recompute'), "
                                 f"got {step!r} -> {(target, mode)!r}")
        self._ensure_cache()
        for layout, model in self.models.items():  # the weights may have changed since the last generation
            if layout not in self.weight_bytes:
                refresh_decode_weights(model)  # in place: captured graphs stay valid
        self._refresh_graphs()
        max_new = max((r.params.max_new_tokens for r in requests), default=1)
        decider = self._decider(max_new) if rank == self.decider_rank and schedule is None else None
        edges = bucket_edges(max_new, self.config.length_buckets)
        trace = GenerationTrace(layouts=[str(layout) for layout in self.chain], refusals=list(self.refused))

        mine = replica_share(requests, start.dp, start.coord(rank).dp)
        own = {r.request_id for r in mine}
        pending: dict[int, Request] = {}  # episodes of this rank's current replica between turns
        turns = episodes.turns if episodes is not None else None

        def finished(r: Request) -> None:
            if on_finish is not None and r.request_id in own:
                on_finish(r)

        def turn_ended(r: Request) -> None:  # a turn of an episode this rank decodes
            pending[r.request_id] = r
            if turns is not None and r.request_id in own:
                turns.ended(r)

        if episodes is not None:
            episodes.start(mine)
        ended = turn_ended if episodes is not None else finished
        layout = start
        engine.submit(mine)
        counts, seconds = [], []
        interval = self.config.interval
        step, begin = 0, time.perf_counter()
        while True:
            if step % interval == 0 or (schedule is not None and step in schedule):
                summary = self._gather(engine, edges, pending)
                if not summary[:, BUSY].any():
                    break
                if episodes is not None and (summary[:, BUSY] == ONLY_PENDING).any():
                    idle = not (summary[:, BUSY] == RUNNABLE).any()  # then wait for an answer
                    answers = self._answers(turns, own, pending, wait=idle, every=episodes.reproducible)
                    apply_answers(engine, pending, answers, finished)
                target, mode, decision = self._decide(layout, summary, step, schedule, decider, trace)
                if target is not None:
                    layout, pending = self._switch(layout, target, mode, step, decision, trace, ended, pending)
                    engine = self.engines[layout]
            tick = time.perf_counter()
            if engine.busy and not engine.stalled:
                engine.step(ended)
            decoded = engine.in_flight  # the rows this step launched
            counts.append(decoded if layout.coord(rank).tp == 0 else 0)  # one count per replica
            seconds.append(time.perf_counter() - tick)
            trace.layout_index.append(self.chain.index(layout))
            step += 1
        trace.wall_seconds = time.perf_counter() - begin
        return self._collect(requests, mine, counts, seconds, trace)

    # ----- decision points -------------------------------------------------------------------

    def _gather(self, engine: GenerationEngine, edges: np.ndarray, pending: Mapping[int, Request]) -> np.ndarray:
        """[ranks of the layout, 3 + 3G]: busy (``RUNNABLE``, ``ONLY_PENDING`` or 0), active,
        waiting, then bucket sums (count, generated, context) of the unfinished requests, by rank."""
        unfinished = engine.active + [r for unit in engine.waiting for r in unit]
        sums = bucket_sums([len(r.output_ids) for r in unfinished], [r.num_tokens for r in unfinished], edges)
        busy = RUNNABLE if engine.busy and not engine.stalled else (ONLY_PENDING if pending else 0.0)
        mine = np.concatenate([[busy, len(engine.active), len(unfinished) - len(engine.active)],
                               sums.reshape(-1)])
        if self.group is None:
            return mine[None]
        local = torch.tensor(mine, dtype=torch.float64, device=engine.device)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)  # the state every decision is made from
        return torch.stack(parts).cpu().numpy()

    def _answers(self, turns: Turns | None, own: set[int], pending: Mapping[int, Request], *,
                 wait: bool, every: bool) -> Answers:
        """Every holder's environment answers, all-gathered over the layout. With ``wait`` (no rank
        has anything to decode) a holder with episodes of its own pending waits for one; with
        ``every``, for all of them (``episodes.collect_answers``)."""
        waiting_for = [request_id for request_id in pending if request_id in own]
        mine = []
        if turns is not None:
            mine = collect_answers(turns, waiting_for, wait=wait and bool(waiting_for), every=every)
        if self.group is None:
            return mine
        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, mine, group=self.group)
        return [answer for part in parts for answer in part]

    def _decide(self, layout: Layout, summary: np.ndarray, step: int, schedule: Schedule | None,
                decider: Decider | None, trace: GenerationTrace) -> tuple[Layout | None, str, Decision | None]:
        """The first rank decides; everyone gets (target, KV mode) by broadcast."""
        code = torch.tensor([-1, 0], dtype=torch.int64, device=self.engines[layout].device)
        decision = None
        if self.world.rank == self.decider_rank:
            tick = time.perf_counter()
            order = sorted(self.chain[0].ranks)  # group rank order of the summary rows
            rows = summary[[order.index(layout.rank_at(0, d, 0)) for d in range(layout.dp)]]
            buckets = (summary.shape[1] - 3) // 3
            loads = Loads.from_sums(*(rows[:, 3 + i * buckets: 3 + (i + 1) * buckets] for i in range(3)))
            active = rows[:, ACTIVE].astype(int).tolist()
            slots = self.engines[layout].cache.num_slots
            if schedule is not None:
                target, mode = schedule.get(step, (None, "auto"))
                if target is not None:
                    target, mode = self._check_forced(layout, target, mode, active, slots, loads, step, trace)
            else:
                decision = decider.decide(layout, loads, active, slots, self._new_graphs)
                target, mode = decision.target, decision.kv_mode
                trace.decisions += 1
                trace.decision_seconds += time.perf_counter() - tick
            if target is not None:
                code = torch.tensor([self.chain.index(target), KV_MODES.index(mode)], dtype=torch.int64,
                                    device=code.device)
        if self.group is not None:
            dist.broadcast(code, src=self.decider_rank, group=self.group)  # every rank acts on one decision
        index, mode_index = code.tolist()
        return (self.chain[index], KV_MODES[mode_index], decision) if index >= 0 else (None, "", None)

    def _check_forced(self, layout: Layout, target: Layout, mode: str, active: list[int], slots: int, loads: Loads,
                      step: int, trace: GenerationTrace) -> tuple[Layout | None, str]:
        """A forced switch as (target, KV mode), or (None, "") refused with the reason logged."""
        try:
            if target not in self.chain:
                raise ValueError(f"{target} is not one of this generator's layouts {[str(x) for x in self.chain]}")
            merge = plan_merge(layout, target)
        except ValueError as e:
            self._refuse(trace.refusals, step, target, str(e))
            return None, ""
        if mode == "auto":
            context = (loads.counts * loads.context).sum(1) / np.maximum(loads.counts.sum(1), 1)  # mean per replica
            fitting = tuple(m for m in KV_MODES if fit_problem(self.cfg, merge, active, slots, m, paged=self.paged)
                            is None)
            cost = self.costs.estimate(merge, np.array(active, float), context, modes=fitting,
                                       weight_bytes=self.weight_bytes.get(target, 0))
            mode = cost.kv_mode if cost is not None else MIGRATE
        problem = fit_problem(self.cfg, merge, active, slots, mode, paged=self.paged)
        if problem is not None:
            self._refuse(trace.refusals, step, target, f"the switch would not fit in memory: {problem}")
            return None, ""
        return target, mode

    @staticmethod
    def _refuse(refusals: list[Refusal], step: int, target: Layout, reason: str) -> None:
        logger.warning("adaptive TP: switch to %s refused at step %d, generation continues in the current "
                       "layout: %s", target, step, reason)
        refusals.append(Refusal(step=step, target=str(target), reason=reason))

    def _decider(self, max_new: int) -> Decider:
        if self.predictor is None:
            self.predictor = LengthPredictor(max_len=max_new, max_samples=self.config.max_samples,
                                             prior_weight=self.config.prior_weight)
        self.predictor.max_len = max_new
        return Decider(cfg=self.cfg, chain=self.chain, steps=self.steps, costs=self.costs, predictor=self.predictor,
                       config=self.config, kv_mode=self.config.kv_mode, weight_bytes=self.weight_bytes)

    def restore_predictor(self, state: dict) -> None:
        """Length history of an earlier run (``predictor.state_dict()``), e.g. on resume."""
        self.predictor = LengthPredictor(max_len=int(state["max_len"]), max_samples=self.config.max_samples,
                                         prior_weight=self.config.prior_weight)
        self.predictor.load_state_dict(state)

    def _new_graphs(self, layout: Layout, batch: float) -> int:
        """Decode graphs a switch to ``layout`` at this batch would capture (one sampling mode)."""
        engine = self.engines[layout]
        if not engine.use_graphs:
            return 0
        top = engine.decode.bucket(max(1, min(int(np.ceil(batch)), engine.cache.num_slots)))
        have = {n for n, _ in engine.decode.graphs}
        return sum(1 for n in engine.decode.buckets if n <= top and n not in have)

    # ----- a switch --------------------------------------------------------------------------

    def _switch(self, layout: Layout, target: Layout, mode: str, step: int, decision: Decision | None,
                trace: GenerationTrace, finished: Callable[[Request], None],
                pending: Mapping[int, Request]) -> tuple[Layout, dict[int, Request]]:
        """Switch to ``target``; returns it and the episodes between turns that this rank's new
        replica holds (they travel with the requests, their KV dropped)."""
        rank, cfg = self.world.rank, self.cfg
        merge = plan_merge(layout, target)
        old, new = self.engines[layout], self.engines[target]
        old.flush(finished)  # the step in flight belongs to the old layout
        device = new.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()

        if target in self.weight_bytes:  # does not nest: the start model's weights, reallocated
            refill(self.world, cfg, self.models[self.chain[0]], target, self.models[target])
            refresh_decode_weights(self.models[target])
        t1 = time.perf_counter()

        # where this rank's requests' KV lies in the old view (the step in flight was read above)
        old_blocks = {r.request_id: old.cache.blocks_of(r.slot) for r in old.active}
        active, waiting = old.detach(finished)
        parts = gather_requests(self.world.groups.get(target.tp_group(rank)), merge, rank, active, waiting,
                                list(pending.values()))
        merged = [r for p in parts for r in p.active]
        between_turns = {r.request_id: r for p in parts for r in p.parked}
        queued = sorted((r for p in parts for r in p.waiting), key=lambda r: r.request_id)  # first come, first served
        t2 = time.perf_counter()

        kv_bytes = extra = 0
        plan = None
        if mode == MIGRATE:
            shard = shard_for(cfg, target, rank)
            item = next(iter(new.cache.k.values())).element_size()
            per_position = shard.num_kv_heads * cfg.head_dim * item
            plan = kv_plan(cfg, merge, merge.dst_replica_of(layout.coord(rank).dp),
                           [(r.request_id, p.replica, r.cached_len) for p in parts for r in p.active],
                           shard.layers, per_position, self.config.bucket_bytes)
            factor = regroup_factor(cfg, merge)
            places = self._places(new.cache, factor, merged, plan.kept[rank], old_blocks)
            if places is None:
                mode, plan = RECOMPUTE, None
        if plan is not None:
            slots, new_blocks = places
            _, kv_bytes = migrate(plan, rank, new.cache, factor, old_blocks, new_blocks)
            extra = plan.peak_buffer_bytes(rank, per_position)
            for r in merged:
                r.slot = slots[r.request_id]
            new.adopt(merged, new_blocks if new.cache.paged else None)
            new.submit(queued)
        else:
            for r in merged:
                r.drop_kv()
            new.submit(merged + queued)
            new.prefill_waiting(finished)
        if cuda:
            torch.cuda.synchronize(device)
        t3 = time.perf_counter()

        if new.active:
            modes = [batch_mode([r.params.temperature for r in new.active], [r.params.top_k for r in new.active],
                                [r.params.top_p for r in new.active])]
            new.warm_graphs(len(new.active), modes)
        t4 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
        if rank == self.decider_rank:
            trace.switches.append(SwitchRecord(
                step=step, source=str(layout), target=str(target), kv_mode=mode, requests=len(merged),
                between_turns=len(between_turns),
                weights_s=t1 - t0, requests_s=t2 - t1, kv_s=t3 - t2, groups_s=0.0, graphs_s=t4 - t3,
                total_s=t4 - t0, weight_bytes=self.weight_bytes.get(target, 0), kv_bytes=kv_bytes,
                extra_bytes_bound=extra, peak_extra_bytes=peak,
                predicted_saving_s=decision.saving_s if decision else None,
                predicted_cost_s=decision.cost.total if decision and decision.cost else None))
            logger.info("adaptive TP: step %d, %s -> %s (%s KV, %d requests) in %.1f ms", step, layout, target,
                        mode, len(merged), (t4 - t0) * 1e3)
        return target, between_turns

    # ----- the end of a generation -----------------------------------------------------------

    def _collect(self, requests: Sequence[Request], mine: list[Request], counts: list[int], seconds: list[float],
                 trace: GenerationTrace) -> list[Request] | None:
        """Results and per-step counts to the first rank (one gather_object over the layout)."""
        start, rank = self.chain[0], self.world.rank
        payload = (result_states(mine) if start.coord(rank).tp == 0 else None, counts, seconds)
        if self.group is None:
            gathered = [payload]
        else:
            gathered = [None] * len(start.ranks) if rank == self.decider_rank else None
            dist.gather_object(payload, gathered, dst=self.decider_rank, group=self.group)
        if rank != self.decider_rank:
            return None
        done = fill_results(requests, [g[0] for g in gathered if g[0] is not None])
        trace.active = np.sum([g[1] for g in gathered], axis=0).astype(int).tolist()
        trace.step_seconds = np.max([g[2] for g in gathered], axis=0).tolist()
        if self.predictor is None:
            self.predictor = LengthPredictor(max_len=max(r.params.max_new_tokens for r in requests),
                                             max_samples=self.config.max_samples,
                                             prior_weight=self.config.prior_weight)
        self.predictor.observe([len(r.output_ids) for r in done])
        self.last_trace = trace
        return done

    # ----- graphs stay valid only while the tensors they read stay where they are ------------

    def _weight_pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for m in self.models.values() for p in m.parameters())

    def _refresh_graphs(self) -> None:
        """Drop captured graphs if the weights' memory moved since (e.g. released and regrown
        between iterations); they are captured again on first use."""
        pointers = self._weight_pointers()
        if pointers != self._pointers:
            for engine in self.engines.values():
                if engine.use_graphs:
                    engine.use_cache(engine.cache)
            self._pointers = pointers

    def release(self) -> None:
        """Free what generation holds besides the start model: the KV cache and the graphs reading
        it, the fused projection copies, and the weights of targets reached by reallocation (e.g.
        to make room for training between iterations). The next ``generate`` makes them again."""
        for engine in self.engines.values():
            engine.release_cache()
        release_storage(p for layout in self.weight_bytes for p in self.models[layout].parameters())

    def _ensure_cache(self) -> None:
        """After ``release``: the cache again, sized from the memory free now (collective)."""
        first = self.engines[self.chain[0]]
        if first.cache is not None:
            return
        for layout in self.weight_bytes:
            for p in self.models[layout].parameters():
                regrow_storage(p)  # filled by reallocation at the switch
        self._fuse_targets()
        first.reset_cache(max_seq_len=first.max_seq_len)
        self._equal_slots()
        for layout in self.chain[1:]:
            self.engines[layout].use_cache(first.cache.regroup(self._heads(layout)))

    def _places(self, cache: KVCache, factor: int, merged: list[Request], kept: Mapping[int, int],
                old_blocks: Mapping[int, list[int]]) -> tuple[dict[int, int], dict[int, list[int]]] | None:
        """Where each merged request's KV lies in the new view ``cache`` after a migration: (slot,
        blocks) by request id. A kept request stays in its old blocks' sub-blocks of its heads; a
        received one goes to clean slots (contiguous) or clean blocks (paged). None if a paged
        cache lacks the clean blocks on some rank of the generator (collective: then every rank
        recomputes instead)."""
        received = [r for r in merged if r.request_id not in kept]
        if not cache.paged:
            clean = clean_slots(cache.num_slots, factor, [b for blocks in old_blocks.values() for b in blocks])
            assert len(received) <= len(clean), "the fit check let through a migration without room"
            slots = {r.request_id: s for r, s in zip(received, clean)}
            slots |= {i: old_blocks[i][0] * factor + sub for i, sub in kept.items()}
            return slots, {i: [s] for i, s in slots.items()}
        clean = cache.clean_blocks(factor, [b for blocks in old_blocks.values() for b in blocks])
        need = [cache.blocks_for(r.cached_len) for r in received]
        fits = torch.tensor([int(sum(need) <= len(clean))], device=self.device)
        if self.group is not None:
            dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.group)
        if not int(fits):
            logger.info("adaptive TP: too few clean KV blocks to migrate into; recomputing instead")
            return None
        blocks = {i: [b * factor + sub for b in old_blocks[i]] for i, sub in kept.items()}
        for r, n in zip(received, need):
            blocks[r.request_id], clean = clean[:n], clean[n:]
        return {r.request_id: s for s, r in enumerate(merged)}, blocks

    def _equal_slots(self) -> None:
        """Give every rank as many KV blocks (slots of a contiguous cache) as the rank with the
        fewest: admission and preemption decisions, taken by each rank alone, must agree within a
        replica and in the fit checks."""
        first = self.engines[self.chain[0]]
        blocks = torch.tensor([first.cache.num_blocks], device=first.device)
        if self.group is not None:
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.group)
        if int(blocks) < first.cache.num_blocks:
            per_block = bytes_per_position(first.model.shard, self.cfg, first.dtype) * first.cache.block_size
            first.reset_cache(max_seq_len=first.max_seq_len, kv_cache_bytes=(int(blocks) + 1) * per_block)

    def _fuse_targets(self) -> None:
        transposed = self._engine_config.transposed_weights
        if self.device.type == "cuda" or transposed:
            for layout in self.chain[1:]:
                make_decode_weights(self.models[layout], transposed)

    def _heads(self, layout: Layout) -> int:
        return shard_for(self.cfg, layout, self.world.rank).num_kv_heads


def _check_requests(requests: Sequence[Request], max_seq_len: int) -> None:
    """The engine's own checks, on every rank for every request, before any collective."""
    for r in requests:
        if r.done or r.slot is not None:
            raise ValueError(f"request {r.request_id} is already finished or admitted elsewhere")
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id} has an empty prompt")
        if r.num_tokens >= max_seq_len:
            raise ValueError(f"request {r.request_id}: {r.num_tokens} tokens leave no room to generate "
                             f"under max_seq_len={max_seq_len}")
