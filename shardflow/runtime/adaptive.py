"""How the RL runtime turns adaptive TP on: the plan's ``tp_targets`` and ``generation.adaptive_tp``.

The runtime builds one generator per generate call and keeps it for the whole run (its engines,
captured graphs and the length predictor carry over between iterations):

    generator = adaptive_generator(world, model, plan["actor_gen"], config.generation,
                                   engine_config=..., eos_token_ids=...)
    done = generator.generate(requests) if generator else generate_replicated(engine, layout, world, requests)

``check_adaptive`` is the pre-launch check of the two settings together. The policy's decode step
times come from ``generation.adaptive_step_times``: a planner profile (``shardflow profile``: one
layer's decode time per tp, batch and context, and the measured rates) or the benchmark's measured
whole steps (``bench/adaptive_tp.py``); without one, from the roofline of an H200.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from shardflow.config.model import ModelConfig
from shardflow.config.settings import GenerationConfig
from shardflow.engine.adaptive.generator import AdaptiveConfig, AdaptiveGenerator
from shardflow.engine.adaptive.switch_policy import PolicyConfig
from shardflow.engine.generate.engine import EngineConfig
from shardflow.models.transformer import Transformer
from shardflow.parallel.world import World
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import FORMAT as PROFILE_FORMAT
from shardflow.perf.profile import OpCosts, Profile
from shardflow.perf.step_time import Hardware, LayerStepTime, RooflineStepTime, StepTimeModel, TableStepTime
from shardflow.plan.execution_plan import CallPlan


def check_adaptive(call_name: str, call: CallPlan, generation: GenerationConfig) -> None:
    """ValueError naming the problem when adaptive TP is on without targets to switch to."""
    if generation.adaptive_tp and not call.tp_targets:
        raise ValueError(f"generation.adaptive_tp is on, but the plan gives {call_name!r} no tp_targets "
                         f"(layouts merging replicas of {call.layout}, e.g. from split_replicas)")


def adaptive_generator(world: World, model: Transformer, call: CallPlan, generation: GenerationConfig, *,
                       engine_config: EngineConfig, eos_token_ids: Sequence[int] = (),
                       call_name: str = "generate") -> AdaptiveGenerator | None:
    """The adaptive generator for a generate call, or None when ``generation.adaptive_tp`` is off
    (the static path). ``model`` is this rank's model in ``call.layout``; collective over its ranks."""
    if not generation.adaptive_tp:
        return None
    check_adaptive(call_name, call, generation)
    steps, hardware = step_times(generation.adaptive_step_times, model.cfg, next(model.parameters()).element_size())
    config = AdaptiveConfig(policy=PolicyConfig(interval=generation.adaptive_interval,
                                                margin=generation.adaptive_margin),
                            kv_mode=generation.adaptive_kv)
    return AdaptiveGenerator(world, model, call.tp_targets, engine_config=engine_config,
                             eos_token_ids=eos_token_ids, config=config, steps=steps, hardware=hardware)


def step_times(path: str, cfg: ModelConfig, dtype_bytes: int) -> tuple[StepTimeModel, Hardware]:
    """The step-time model and hardware rates from ``path`` (a planner profile or measured decode
    steps), or the roofline of an H200 when ``path`` is empty."""
    if not path:
        return RooflineStepTime(cfg, dtype_bytes=dtype_bytes), Hardware()
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"adaptive TP step-time file {file} does not exist")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"adaptive TP step-time file {file} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("format") == PROFILE_FORMAT:
        profile = Profile.from_dict(raw, where=f"profile file {file}")
        cluster = profile.cluster(Cluster())
        hardware = Hardware(hbm_bandwidth=cluster.hbm_bandwidth, matmul_flops=cluster.matmul_flops,
                            bus_bandwidth=cluster.intra_node_bandwidth, p2p_bandwidth=cluster.p2p_bandwidth,
                            collective_latency=cluster.intra_node_latency)
        costs = OpCosts(cluster, profile)
        return LayerStepTime(lambda tp, batch, context: costs.decode_layer(cfg, tp, batch, context),
                             RooflineStepTime(cfg, hardware, dtype_bytes=dtype_bytes)), hardware
    return TableStepTime.load(file, RooflineStepTime(cfg, dtype_bytes=dtype_bytes)), Hardware()
