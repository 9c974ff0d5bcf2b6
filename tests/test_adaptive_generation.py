"""Adaptive TP on gloo ranks: generation with switches gives exactly the tokens of generation
without them (the engine's static path), for several layouts, switch points, KV modes and
sampling; refused switches leave generation running in the current layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gen_helpers import prompts

from shardflow.config.experiment import AdaptiveConfig
from shardflow.engine.adaptive.generator import AdaptiveGenerator
from shardflow.engine.adaptive.trace import GenerationTrace, plot_trace
from shardflow.engine.generate.decode_weights import make_decode_weights
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.replicas import generate_replicated, replica_share
from shardflow.engine.generate.requests import SamplingParams, make_requests
from shardflow.models.checkpoint import load_model
from shardflow.parallel.layout import Layout
from shardflow.plan.execution_plan import CallPlan
from shardflow.runtime.calls.generate import adaptive_generator

# float32 on both sides; a switch changes tp, which only reorders sums (a few ulps).
LOGPROB_ATOL = 1e-4
GREEDY = [dict(max_new_tokens=12, temperature=0.0)]
MIXED = [dict(max_new_tokens=12, temperature=0.0), dict(max_new_tokens=9, temperature=1.0, seed=7),
         dict(max_new_tokens=12, temperature=0.8, top_k=20, seed=3),
         dict(max_new_tokens=5, temperature=1.2, top_p=0.9, seed=5)]


class TailFavouringSteps:
    """Synthetic step times: per replica, tp=1 takes 1 s + 1 s per request, tp=2 0.2 s + 0.75 s
    per request, so merging two replicas pays once each has about one request left."""

    def decode(self, tp, batch, context):
        batch = np.asarray(batch, dtype=np.float64)
        return 1.0 + batch if tp == 1 else 0.2 + 0.75 * batch

    def prefill(self, tp, tokens, context):
        return 0.01


def adaptive_job(world, path: str, start: str, targets: list[str], runs: dict, params: list[dict], samples: int,
                 engine_kwargs: dict, interval: int, steps=None, release=False, fuse=False):
    """Each run: a forced schedule {step: (layout, KV mode)}, or None for the policy. The
    reference is the plain engine (``generate_replicated``) in the starting layout."""
    start_l, target_ls = Layout.parse(start), [Layout.parse(t) for t in targets]
    world.create_groups([start_l, *target_ls])
    if world.rank not in start_l:
        return None
    model, _ = load_model(path, start_l, world)
    ids = prompts(model.cfg.vocab_size)
    per_prompt = [SamplingParams(**params[i % len(params)]) for i in range(len(ids))]
    config = EngineConfig(**engine_kwargs)
    static = generate_replicated(GenerationEngine(model, config, eos_token_ids=model.cfg.eos_token_ids), start_l, world,
                                 make_requests(ids, per_prompt, samples))
    if steps is None:  # the runtime's way in: the plan's targets and the adaptive settings
        plan = CallPlan(layout=start_l, tp_targets=tuple(target_ls))
        generator = adaptive_generator(world, model, plan.tp_targets, AdaptiveConfig(enabled=True, interval=interval),
                                       engine_config=config, eos_token_ids=model.cfg.eos_token_ids)
    else:
        generator = AdaptiveGenerator(world, model, target_ls, engine_config=config,
                                      eos_token_ids=model.cfg.eos_token_ids,
                                      config=AdaptiveConfig(interval=interval), steps=steps)
    if fuse:  # what GPU engines decode with: concatenated q/k/v and gate/up copies, refreshed per generation
        for m in generator.models.values():
            make_decode_weights(m)
    out = {"static": static and [(r.output_ids, r.output_logprobs, r.finish_reason) for r in static],
           "refused": [r.reason for r in generator.refused], "finish_ok": True}
    for name, schedule in runs.items():
        requests = make_requests(ids, per_prompt, samples)
        called = []
        forced = None if schedule is None else {s: (Layout.parse(t), m) for s, (t, m) in schedule.items()}
        done = generator.generate(requests, called.append, schedule=forced)
        if release:  # as the runtime does between iterations: memory back for training
            generator.release()
        share = replica_share(requests, start_l.dp, start_l.coord(world.rank).dp)
        out["finish_ok"] &= sorted(r.request_id for r in called) == sorted(r.request_id for r in share)
        if done is not None:
            trace = generator.last_trace
            out[name] = dict(outputs=[(r.output_ids, r.output_logprobs, r.finish_reason) for r in done],
                             switches=[(s.step, s.target, s.kv_mode, s.requests) for s in trace.switches],
                             weight_bytes=[s.weight_bytes for s in trace.switches],
                             refusals=[(f.step, f.target, f.reason) for f in trace.refusals],
                             trace=trace.to_dict())
    return out


def run(pool, checkpoints, case: str, start: str, targets: list[str], runs: dict, *, params=GREEDY, samples=2,
        engine_kwargs=None, interval=4, steps=None, release=False, fuse=False, family="llama", **ckpt):
    path = checkpoints.get(case, family, **ckpt)
    kwargs = dict(max_seq_len=64) | (engine_kwargs or {})
    results = [r for r in pool.run(adaptive_job, path, start, targets, runs, params, samples, kwargs, interval, steps,
                                   release, fuse) if r is not None]
    assert all(r["finish_ok"] for r in results), "on_finish must see exactly each rank's starting share"
    [first] = [r for r in results if r["static"] is not None]
    for name in runs:
        assert_same(first, name)
    return first


def assert_same(result: dict, name: str) -> None:
    assert len(result[name]["outputs"]) == len(result["static"])
    for i, ((tokens, logprobs, finish), (ref_tokens, ref_logprobs, ref_finish)) in enumerate(
            zip(result[name]["outputs"], result["static"])):
        assert tokens == ref_tokens, f"{name}: request {i}"
        assert finish == ref_finish, f"{name}: request {i}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=LOGPROB_ATOL, rtol=0)


def test_d2t1_to_d1t2_migrated_and_recomputed_at_several_steps(pool, checkpoints):
    runs = {f"{mode}@{step}": {step: ("d1p1t2@0-1", mode)} for mode in ("migrate", "recompute") for step in (1, 5)}
    runs["never"] = {}
    # the first target is not a merge of the start (other ranks): refused when the generator is built
    result = run(pool, checkpoints, "llama", "d2p1t1@0-1", ["d1p1t2@2-3", "d1p1t2@0-1"], runs, params=MIXED)
    assert len(result["refused"]) == 1 and "not reachable from d2p1t1@0-1" in result["refused"][0]
    for mode in ("migrate", "recompute"):
        assert result[f"{mode}@1"]["switches"] == [(1, "d1p1t2@0-1", mode, 8)]  # 4 prompts x 2 samples
        assert result[f"{mode}@5"]["switches"] == [(5, "d1p1t2@0-1", mode, 6)]  # two ended at 5 tokens
        assert result[f"{mode}@5"]["weight_bytes"] == [0]  # views of the start model's weights
    assert result["never"]["switches"] == []


def test_two_switches_d4t1_d2t2_d1t4_and_an_unreachable_one_refused(pool, checkpoints):
    final = "d1p1t4@0-3"
    middle = "d2p1t2@0,2,1,3"
    runs = {"migrate,migrate": {2: (middle, "migrate"), 6: (final, "migrate")},
            "recompute,migrate": {1: (middle, "recompute"), 4: (final, "migrate")},
            "jump by 4": {3: (final, "recompute")},
            "back": {2: (final, "migrate"), 4: (middle, "migrate")}}
    result = run(pool, checkpoints, "llama", "d4p1t1@0,2,1,3", [middle, final], runs, params=MIXED)
    assert [s[:3] for s in result["migrate,migrate"]["switches"]] == [(2, middle, "migrate"), (6, final, "migrate")]
    assert [s[:3] for s in result["recompute,migrate"]["switches"]] == [(1, middle, "recompute"),
                                                                        (4, final, "migrate")]
    assert [s[:3] for s in result["jump by 4"]["switches"]] == [(3, final, "recompute")]
    assert [s[:3] for s in result["back"]["switches"]] == [(2, final, "migrate")]
    [(step, target, reason)] = result["back"]["refusals"]
    assert (step, target) == (4, middle) and "not reachable from d1p1t4@0-3 by merging" in reason


def test_a_paged_cache_migrates_by_block(pool, checkpoints):
    """With a paged KV cache (views regrouped by block) switches migrate the heads into clean blocks
    of the new view, recompute, or choose; the tokens are the static run's."""
    final, middle = "d1p1t4@0-3", "d2p1t2@0,2,1,3"
    runs = {"migrate,migrate": {2: (middle, "migrate"), 6: (final, "migrate")},
            "recompute,auto": {1: (middle, "recompute"), 5: (final, "auto")}}
    result = run(pool, checkpoints, "llama", "d4p1t1@0,2,1,3", [middle, final], runs, params=MIXED,
                 engine_kwargs=dict(kv_block_size=16))
    assert [s[:3] for s in result["migrate,migrate"]["switches"]] == [(2, middle, "migrate"), (6, final, "migrate")]
    assert [s[:3] for s in result["recompute,auto"]["switches"]][0] == (1, middle, "recompute")
    assert sum(s["kv_bytes"] for s in result["migrate,migrate"]["trace"]["switches"]) > 0


def test_a_paged_migration_without_clean_blocks_recomputes(pool, checkpoints):
    """Every block of the old view holding KV of a request on the rank leaves no clean block to
    receive into: the ranks agree to recompute instead, and the tokens are still the static run's."""
    runs = {"migrate": {6: ("d1p1t2@0-1", "migrate")}}
    # 4 requests of up to 30 + 12 tokens per replica in 5 blocks of 16: the old blocks in use leave too few
    result = run(pool, checkpoints, "llama", "d2p1t1@0-1", ["d1p1t2@0-1"], runs, params=MIXED,
                 engine_kwargs=dict(kv_block_size=16, max_batch_size=8, kv_cache_bytes=6 * 16 * 2 * 4 * 2 * 16 * 4))
    assert [s[:3] for s in result["migrate"]["switches"]] == [(6, "d1p1t2@0-1", "recompute")]


def test_tp_beyond_kv_heads(pool, checkpoints):
    """tp=4 over 2 KV heads: two ranks share each head (and receive it from different holders)."""
    runs = {"migrate": {3: ("d1p1t4@0-3", "migrate")}, "recompute": {3: ("d1p1t4@0-3", "recompute")}}
    result = run(pool, checkpoints, "llama", "d2p1t2@0,2,1,3", ["d1p1t4@0-3"], runs, params=MIXED)
    assert [s[:3] for s in result["migrate"]["switches"]] == [(3, "d1p1t4@0-3", "migrate")]
    assert [s[:3] for s in result["recompute"]["switches"]] == [(3, "d1p1t4@0-3", "recompute")]


def test_a_switch_that_does_not_fit_is_refused_until_it_fits(pool, checkpoints):
    """With tp beyond the KV heads the merged cache has no more slots than before: two slots per
    replica, both taken, cannot hold four requests. Refused; once two requests have ended it fits."""
    runs = {"too full": {1: ("d1p1t4@0-3", "migrate"), 9: ("d1p1t4@0-3", "auto")}}
    result = run(pool, checkpoints, "llama", "d2p1t2@0,2,1,3", ["d1p1t4@0-3"], runs, params=MIXED, samples=1,
                 engine_kwargs=dict(max_batch_size=2))
    [(step, _, reason)] = result["too full"]["refusals"]
    assert step == 1 and "would not fit in memory" in reason and "would decode 4 requests" in reason
    assert [s[:2] for s in result["too full"]["switches"]] == [(9, "d1p1t4@0-3")]


@pytest.mark.parametrize("transposed", [False, True])
def test_layouts_that_do_not_nest_reallocate_the_weights(pool, checkpoints, transposed):
    """The target's own weights are filled by reallocation at each switch; between generations the
    generator releases them with the KV cache, as the runtime does. With ``transposed`` every
    engine decodes from transposed copies, which must follow the reallocated weights."""
    runs = {"migrate": {2: ("d1p1t4@0-3", "migrate")}, "recompute": {4: ("d1p1t4@0-3", "recompute")}}
    result = run(pool, checkpoints, "llama", "d2p1t2@0-3", ["d1p1t4@0-3"], runs, params=MIXED, release=True,
                 engine_kwargs=dict(transposed_weights=transposed))
    for name in runs:
        assert len(result[name]["switches"]) == 1 and result[name]["weight_bytes"][0] > 0


@pytest.mark.parametrize("case,kwargs", [("qwen2_bias", dict(family="qwen2", vocab_size=130)),
                                         ("qwen3_tied", dict(family="qwen3", tie_word_embeddings=True)),
                                         ("mistral_window", dict(family="mistral"))])
def test_model_families(pool, checkpoints, case, kwargs):
    """Biases, a padded vocabulary, tied embeddings and a sliding window through a switch, decoding
    with fused projection copies as GPU engines do."""
    runs = {"migrate": {3: ("d1p1t2@0-1", "migrate")}}
    result = run(pool, checkpoints, case, "d2p1t1@0-1", ["d1p1t2@0-1"], runs, params=MIXED, fuse=True, **kwargs)
    assert len(result["migrate"]["switches"]) == 1


def test_the_policy_switches_when_it_pays(pool, checkpoints, tmp_path):
    """No schedule: the policy decides every 2 steps on synthetic step times where merging pays only
    once the replicas' batches shrink (replica 1's prompts end after 5 and 9 tokens, replica 0's
    after 12): the switch comes mid-decode, in both generations (the second with the lengths of the
    first learned). Tokens are those of the static path."""
    runs = {"first": None, "second": None}
    result = run(pool, checkpoints, "llama", "d2p1t1@0-1", ["d1p1t2@0-1"], runs, params=MIXED,
                 interval=2, steps=TailFavouringSteps())
    for name in runs:
        trace = GenerationTrace.from_dict(result[name]["trace"])
        [(step, target, _, requests)] = result[name]["switches"]
        assert target == "d1p1t2@0-1" and 0 < step < len(trace.active)
        assert requests == trace.active[step] < trace.active[0]  # after the first requests ended
        assert trace.decisions > 0 and trace.layout_index[-1] == 1
        assert plot_trace(trace, tmp_path / f"{name}.png").stat().st_size > 0
