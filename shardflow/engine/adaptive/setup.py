"""How the RL runtime turns adaptive TP on: the plan's ``tp_targets`` and ``generation.adaptive_tp``.

The runtime builds one generator per generate call and keeps it for the whole run (its engines,
captured graphs and the length predictor carry over between iterations):

    generator = adaptive_generator(world, model, plan["actor_gen"], config.generation,
                                   engine_config=..., eos_token_ids=...)
    done = generator.generate(requests) if generator else generate_replicated(engine, layout, world, requests)

``check_adaptive`` is the pre-launch check of the two settings together.
"""

from __future__ import annotations

from typing import Sequence

from shardflow.config import GenerationConfig
from shardflow.engine.adaptive.generator import AdaptiveConfig, AdaptiveGenerator
from shardflow.engine.adaptive.step_time import RooflineStepTime, TableStepTime
from shardflow.engine.adaptive.switch_policy import PolicyConfig
from shardflow.engine.generate import EngineConfig
from shardflow.models.transformer import Transformer
from shardflow.plan.execution_plan import CallPlan
from shardflow.parallel.world import World


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
    steps = None
    if generation.adaptive_step_times:
        item = next(model.parameters()).element_size()
        steps = TableStepTime.load(generation.adaptive_step_times, RooflineStepTime(model.cfg, dtype_bytes=item))
    config = AdaptiveConfig(policy=PolicyConfig(interval=generation.adaptive_interval,
                                                margin=generation.adaptive_margin),
                            kv_mode=generation.adaptive_kv)
    return AdaptiveGenerator(world, model, call.tp_targets, engine_config=engine_config,
                             eos_token_ids=eos_token_ids, config=config, steps=steps)
