"""Adaptive TP pieces on one process: which merges are reachable and nest, target weights as views
of the start model (equal to loading the target layout), the regrouped KV cache, the KV moves."""

from __future__ import annotations

import pytest
import torch

from shardflow.config.load import load_config
from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.kv_migration import clean_slots, fit_problem, keeps_own, kv_plan, regroup_factor
from shardflow.engine.adaptive.merge import nests, plan_merge
from shardflow.engine.adaptive.reshard import view_model
from shardflow.engine.generate.decode_weights import (
    decode_weights_layout,
    drop_decode_weights,
    make_decode_weights,
    refresh_decode_weights,
)
from shardflow.engine.generate.kv_cache import KVCache
from shardflow.models.checkpoint import load_weights
from shardflow.models.tiny import tiny_hf_config
from shardflow.models.transformer import build_model
from shardflow.parallel.layout import Layout, split_replicas
from shardflow.parallel.sharding import shard_for
from shardflow.runtime.validate import check_config, check_plan

L = Layout.parse


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_hf_config("llama", **overrides).to_dict())


def test_reachable_merges_and_refusals():
    merge = plan_merge(L("d4p1t1@0,2,1,3"), L("d2p1t2@0,2,1,3"))
    assert merge.groups == ((0, 1), (2, 3)) and merge.factor == 2 and merge.dst_replica_of(3) == 1
    assert plan_merge(L("d4p1t1@0-3"), L("d1p1t4@0-3")).groups == ((0, 1, 2, 3),)
    mixed = Layout((0, 1, 2, 4, 3, 5, 6, 7), dp=2, tp=4)  # replicas {0,1,2,4} and {3,5,6,7}
    for src, dst, why in [(L("d2p1t1@0-1"), L("d1p1t2@2-3"), "the two layouts must use the same ranks"),
                          (L("d2p1t2@0-3"), L("d2p1t2@0,2,1,3"), "tp must grow by a whole factor of at least 2"),
                          (L("d2p1t1@0-1"), L("d1p2t1@0-1"), "generation runs with pp=1"),
                          (L("d4p1t2@0-7"), mixed, r"replica 0 of .* \(ranks \[0, 1, 2, 4\]\) is not a union")]:
        with pytest.raises(ValueError, match=f"{dst} is not reachable from {src} by merging data-parallel "
                                             f"replicas: {why}"):
            plan_merge(src, dst)


def test_nesting_follows_split_replicas():
    cfg = tiny(num_attention_heads=8, num_key_value_heads=2, vocab_size=130)
    final = Layout.contiguous(tp=8)
    chain = [split_replicas(final, 8), split_replicas(final, 4), split_replicas(final, 2), final]
    for i, src in enumerate(chain):
        for dst in chain[i + 1:]:
            assert nests(cfg, src, dst), (str(src), str(dst))
    assert nests(cfg, L("d4p1t1@0-3"), L("d1p1t4@0-3"))  # tp=1 holds everything
    assert not nests(cfg, L("d2p1t2@0-3"), L("d1p1t4@0-3"))


@pytest.mark.parametrize("case,kwargs,start,target", [
    ("llama", dict(family="llama"), "d4p1t1@0,2,1,3", "d2p1t2@0,2,1,3"),
    ("llama", dict(family="llama"), "d2p1t2@0,2,1,3", "d1p1t4@0-3"),  # tp 4 > 2 KV heads
    ("qwen2_bias", dict(family="qwen2", vocab_size=130), "d2p1t1@0-1", "d1p1t2@0-1"),  # padded vocabulary
    ("qwen3_tied", dict(family="qwen3", tie_word_embeddings=True), "d4p1t1@0-3", "d1p1t4@0-3"),
])
def test_view_model_equals_loading_the_target_layout(checkpoints, case, kwargs, start, target):
    path = checkpoints.get(case, **kwargs)
    cfg = ModelConfig.from_pretrained(path)
    start_l, target_l = L(start), L(target)
    for rank in target_l.ranks:
        shard = shard_for(cfg, start_l, rank)
        start_model = build_model(cfg, shard, None, "cpu", torch.float32)
        load_weights(start_model, shard, path)
        views = view_model(cfg, start_model, target_l, rank, None)
        target_shard = shard_for(cfg, target_l, rank)
        loaded = build_model(cfg, target_shard, None, "cpu", torch.float32)
        load_weights(loaded, target_shard, path)
        expected = dict(loaded.named_parameters())
        storages = {p.untyped_storage().data_ptr() for p in start_model.parameters()}
        for name, p in views.named_parameters():
            assert torch.equal(p, expected[name]), (case, rank, name)
            assert p.untyped_storage().data_ptr() in storages  # a view: nothing copied
        assert views.shard.layout == target_l and views.real_vocab == loaded.real_vocab


def test_view_model_refuses_layouts_that_do_not_nest(checkpoints):
    cfg = tiny()
    model = build_model(cfg, shard_for(cfg, L("d2p1t2@0-3"), 1), None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="does not nest in d2p1t2@0-3"):
        view_model(cfg, model, L("d1p1t4@0-3"), 1, None)


def test_regrouped_cache_is_the_same_memory_split_by_heads():
    cache = KVCache.zeros(layers=(0, 1), num_slots=3, num_kv_heads=4, max_len=5, head_dim=2, dtype=torch.float32,
                          device="cpu")
    cache.k[1].copy_(torch.arange(cache.k[1].numel(), dtype=torch.float32).view_as(cache.k[1]))
    half = cache.regroup(2)
    assert half.num_slots == 7 and half.num_kv_heads == 2 and half.scratch_slot == 7
    for s in range(4):
        for j in range(2):
            assert torch.equal(half.k[1][s * 2 + j], cache.k[1][s, 2 * j: 2 * j + 2])
    assert half.k[1].untyped_storage().data_ptr() == cache.k[1].untyped_storage().data_ptr()
    assert cache.regroup(4).num_slots == 3
    with pytest.raises(ValueError, match="cannot regroup a cache of 4 KV heads per slot into 3"):
        cache.regroup(3)
    cache.allocate(2)
    cache.release_all()
    assert cache.num_free == 3
    cache.reserve([2])
    assert cache.allocate(2) == [0, 1] and cache.num_free == 0


def test_kv_plan_keeps_own_heads_and_receives_the_rest():
    cfg = tiny()  # 2 KV heads of 16, 4 layers
    merge = plan_merge(L("d2p1t1@0-1"), L("d1p1t2@0-1"))
    assert regroup_factor(cfg, merge) == 2 and keeps_own(cfg, merge, 0) and keeps_own(cfg, merge, 1)
    per_position = 1 * 16 * 4  # one head of 16 float32
    requests = [(10, 0, 7), (11, 1, 5), (12, 1, 3)]  # (id, old replica, cached length)
    plan = kv_plan(cfg, merge, 0, requests, range(4), per_position, bucket_bytes=1 << 20)
    assert plan.kept == {0: {10: 0}, 1: {11: 1, 12: 1}}  # rank 1 holds head 1: second half of its slots
    assert plan.received == {0: [11, 12], 1: [10]}
    [[to_rank0]] = [plan.messages[(1, 0)]]
    assert {(c.request_id, c.sub) for c in to_rank0} == {(11, 0), (12, 0)}
    assert sum(c.stop - c.start for c in to_rank0) == (5 + 3) * 4 * 2  # positions x layers x (k, v)
    assert plan.bytes_moved(0, per_position) == (7 * 8 * per_position, 8 * 8 * per_position)
    small = kv_plan(cfg, merge, 0, requests, range(4), per_position, bucket_bytes=3 * per_position)
    assert all(sum((c.stop - c.start) * per_position for c in m) <= 3 * per_position
               for buckets in small.messages.values() for m in buckets)
    assert small.peak_buffer_bytes(0, per_position) <= 2 * 3 * per_position
    # tp 4 over 2 KV heads, layouts that do not nest: rank 1 needs head 0, which rank 0 holds
    merge = plan_merge(L("d2p1t2@0-3"), L("d1p1t4@0-3"))
    assert not keeps_own(cfg, merge, 1) and regroup_factor(cfg, merge) == 1
    plan = kv_plan(cfg, merge, 0, [(5, 0, 4)], range(4), per_position, 1 << 20)
    assert plan.kept == {0: {5: 0}, 1: {}, 2: {}, 3: {}} and set(plan.messages) == {(0, 1), (1, 2), (1, 3)}


def test_what_fits_in_the_caches():
    cfg = tiny()
    merge = plan_merge(L("d2p1t1@0-1"), L("d1p1t2@0-1"))  # regrouped slots: (3 + 1) * 2 - 1 = 7
    assert fit_problem(cfg, merge, [3, 3], 3, "recompute") is None
    assert "needs 3 free KV slots on rank 0, which has 1" in fit_problem(cfg, merge, [3, 3], 3, "migrate")
    assert fit_problem(cfg, merge, [2, 1], 3, "migrate") is None
    replicated = plan_merge(L("d2p1t2@0,2,1,3"), L("d1p1t4@0-3"))  # one head per rank before and after
    assert "would decode 4 requests, but a rank's KV cache holds 3" in fit_problem(cfg, replicated, [2, 2], 3,
                                                                                   "recompute")
    assert clean_slots(7, 2, [1]) == [0, 1, 4, 5, 6]


def test_configuration_turns_it_on_and_checks_it():
    base = {"models": {"actor": {"path": "x"}}, "data": {"path": "x"}, "run": {"devices": 2},
            "generation": {"samples_per_prompt": 2}}
    config = load_config(None, [], base=base)
    graph = check_config(config).graph
    models = {"actor": ModelConfig.from_hf_dict(tiny_hf_config("llama").to_dict())}
    assert not check_plan(config, graph, models)["actor_gen"].tp_targets  # off: the static path needs none
    with pytest.raises(ValueError, match="plan gives 'actor_gen' no tp_targets"):
        check_plan(load_config(None, ["generation.adaptive.enabled=true"], base=base), graph, models)
    with pytest.raises(ValueError, match="generation.adaptive.kv_mode must be one of auto, migrate, recompute"):
        load_config(None, ["generation.adaptive.kv_mode=copy"], base=base)


def test_one_rank_generator_refusals_and_bad_schedules(checkpoints):
    """A one-rank layout has nothing to merge: targets are refused when the generator is built and it
    generates what the plain engine does; malformed forced switches are errors before any work."""
    from gen_helpers import local_model, prompts

    from shardflow.engine.adaptive.generator import AdaptiveGenerator
    from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
    from shardflow.engine.generate.requests import SamplingParams, make_requests
    from shardflow.parallel.world import World

    model = local_model(checkpoints.get("llama", "llama"))
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    generator = AdaptiveGenerator(world, model, [L("d1p1t2@0-1")], engine_config=EngineConfig(max_seq_len=64))
    [refusal] = generator.refused
    assert refusal.step == -1 and "d1p1t2@0-1 is not reachable from d1p1t1@0" in refusal.reason
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    reference = GenerationEngine(model, EngineConfig(max_seq_len=64)).generate(make_requests(prompts(), params))
    done = generator.generate(make_requests(prompts(), params))
    assert [r.output_ids for r in done] == [r.output_ids for r in reference]
    assert generator.last_trace.switches == [] and len(generator.last_trace.refusals) == 1
    generator.release()  # the KV cache goes, and comes back for the next generation
    assert generator.engines[L("d1p1t1@0")].cache is None
    again = generator.generate(make_requests(prompts(), params))
    assert [r.output_ids for r in again] == [r.output_ids for r in reference]
    for bad in ({-1: (L("d1p1t1@0"), "auto")}, {3: ("d1p1t1@0", "auto")}, {3: (L("d1p1t1@0"), "copy")}):
        with pytest.raises(ValueError, match="a forced switch must be step"):
            generator.generate(make_requests(prompts(), params), schedule=bad)
    with pytest.raises(ValueError, match="leave no room to generate"):
        generator.generate(make_requests([[5] * 70], params))


@pytest.mark.parametrize("transposed", [False, True])
def test_decode_weight_copies_refresh_in_place(transposed):
    """Decoding engines read copies of the weights (q/k/v and gate/up concatenated; with
    ``transposed`` every decode product's weight stored [in, out]); refreshing them after the
    weights change keeps their memory (graphs captured over them stay valid) and their values follow."""
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("qwen2").to_dict())  # q/k/v biases, untied head
    model = build_model(cfg, shard_for(cfg, L("d1p1t1@0"), 0), None, "cpu", torch.float32)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    make_decode_weights(model, transposed)
    attn, mlp = model.model.layers["0"].self_attn, model.model.layers["0"].mlp
    copies = [attn.decode_qkv.weight, attn.decode_qkv.bias, mlp.decode_gate_up.weight]
    if transposed:
        copies += [attn.o_proj.decode_weight.weight, mlp.down_proj.decode_weight.weight, model.decode_head.weight]
    pointers = [t.data_ptr() for t in copies]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    refresh_decode_weights(model)
    assert [t.data_ptr() for t in copies] == pointers
    assert decode_weights_layout(model) == ("transposed" if transposed else "concatenated")

    def stored(w):
        return w.t() if transposed else w
    assert torch.equal(stored(attn.decode_qkv.weight),
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(attn.decode_qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(stored(mlp.decode_gate_up.weight), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    if transposed:
        assert torch.equal(attn.o_proj.decode_weight.weight.t(), attn.o_proj.weight)
        assert torch.equal(mlp.down_proj.decode_weight.weight.t(), mlp.down_proj.weight)
        assert torch.equal(model.decode_head.weight.t(), model.lm_head.weight)
        assert attn.o_proj.decode_weight.weight.is_contiguous()
    else:
        assert attn.o_proj.decode_weight is None and model.decode_head is None
    # Without gradients the forward reads the copies, with gradients the parameters: the same values.
    ids = torch.tensor([[3, 5, 7, 9]])
    positions = torch.arange(4)[None]
    with torch.no_grad():
        decoded = model.logits(model(ids, positions))
    trained = model.logits(model(ids, positions))
    torch.testing.assert_close(decoded, trained, rtol=1e-5, atol=1e-4)
    drop_decode_weights(model)
    assert decode_weights_layout(model) is None and model.decode_head is None


def test_step_times_from_a_planner_profile_or_measured_steps(tmp_path):
    import numpy as np

    from shardflow.perf.hardware import Cluster
    from shardflow.perf.profile import LayerProfile, Profile, Table, layer_key
    from shardflow.perf.roofline import Roofline, head_shape
    from shardflow.perf.step_time import OpStepTime, TableStepTime, roofline_steps
    from shardflow.perf.step_time import load_step_times as step_times

    cfg = tiny()
    flat = Table((1.0,), (1.0,))
    layers = {tp: LayerProfile(forward=flat, backward=flat, optimizer_per_param=1e-12,
                               decode=Table((1.0, 8.0), ((1e-4 * tp, 2e-4 * tp), (3e-4 * tp, 4e-4 * tp)),
                                            (10.0, 100.0)))
              for tp in (1, 2)}
    Profile(device="test", rates={"p2p_bandwidth": 1e11, "intra_node_latency": 2e-5},
            layers={layer_key(cfg): layers}).save(tmp_path / "profile.json")
    steps, cluster = step_times(str(tmp_path / "profile.json"), cfg, 4)
    assert isinstance(steps, OpStepTime) and cluster.p2p_bandwidth == 1e11 and cluster.intra_node_latency == 2e-5
    head = Roofline(dtype_bytes=4).head_forward(head_shape(cfg, 2), cluster, 1.0)  # not profiled: the roofline
    ring = 2e-5 + 64 * 4 / cluster.intra_node_bandwidth  # one row of hidden states, in float32
    expected = 4 * 1e-4 * 2 + head + (2 * 4 + 1) * ring  # the measured layer step at (batch 1, context 10)
    assert steps.decode(2, np.array([1.0]), np.array([10.0]))[0] == pytest.approx(expected)

    TableStepTime({}, roofline_steps(cfg, dtype_bytes=4)).save(tmp_path / "steps.json")
    steps, cluster = step_times(str(tmp_path / "steps.json"), cfg, 4)
    assert isinstance(steps, TableStepTime) and cluster == Cluster()
    assert isinstance(step_times("", cfg, 2)[0], OpStepTime)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        step_times(str(tmp_path / "broken.json"), cfg, 2)
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        step_times(str(tmp_path / "missing.json"), cfg, 2)
