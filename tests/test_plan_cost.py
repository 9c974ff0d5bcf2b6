"""Cost, memory and transfer models against hand-derived formulas and brute force."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from planner_cases import llama, small_problem, tiny

from shardflow.config.model import ModelConfig
from shardflow.engine.generate.decode_weights import make_decode_weights
from shardflow.parallel.layout import Layout
from shardflow.parallel.realloc_plan import transfer_plan
from shardflow.parallel.sharding import shard_for
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import OpCosts, Profile, Table
from shardflow.perf.roofline import layer_shape
from shardflow.perf.transfer import realloc_seconds, received_bytes
from shardflow.plan import memory as mem
from shardflow.plan.cost import CostModel
from shardflow.plan.estimate import estimate
from shardflow.plan.problem import Choice
from shardflow.plan.workload import Workload


class LinearOps(OpCosts):
    """Operation costs simple enough to write the call times by hand."""

    def layer_forward(self, cfg, tp, tokens, seqlen):
        return 1e-6 * tokens / tp

    def layer_backward(self, cfg, tp, tokens, seqlen):
        return 2e-6 * tokens / tp

    def decode_layer(self, cfg, tp, batch, context):
        return 1e-4 + 1e-7 * batch * context / tp

    def _attention(self, cfg, tp, kind, x, seqlen):
        # 1e-9 s per (token, position), 2.5x backward; packed attention's gathers 1e-7 s per key slot
        return 1e-9 * x * seqlen * (2.5 if kind.endswith("backward") else 1) + (1e-7 * x if kind.startswith("packed") else 0)

    def head_forward(self, cfg, tp, tokens):
        return 5e-7 * tokens

    def head_backward(self, cfg, tp, tokens):
        return 1e-6 * tokens

    def optimizer(self, cfg, tp, params):
        return 1e-12 * params

    def grad_accumulate(self, cfg, tp, params):
        return 3e-13 * params


def test_generation_time_by_hand():
    cfg, P, N, m = llama(), 100, 41, 8
    w = Workload(prompts=m, prompt_tokens=P, max_new_tokens=N, response_mean=N)  # every response N tokens
    costs = CostModel(LinearOps(Cluster.for_devices(1)), w)
    layout = Layout((0,))
    L = cfg.num_layers

    def step(batch):  # a decode step at the mean context of a wave, tp = 1 (no collectives)
        return L * (1e-4 + 1e-7 * batch * (P + (N - 1) / 2)) + 5e-7 * batch

    def prefill(requests):
        return L * 1e-6 * requests * P + 5e-7 * requests

    # all requests in one wave: the prefill gives the first token, N - 1 decode steps follow
    assert costs.generate(cfg, layout, m) == pytest.approx(prefill(m) + (N - 1) * step(m))
    # half the slots: two waves, the second admitted when the first finishes
    assert costs.generate(cfg, layout, m // 2) == pytest.approx(2 * prefill(m // 2) + 2 * (N - 1) * step(m // 2))


def test_generation_batch_shrinks_with_skewed_lengths():
    cfg = llama()
    skewed = Workload(prompts=64, prompt_tokens=128, max_new_tokens=1024, response_mean=256, response_std=256)
    even = Workload(prompts=64, prompt_tokens=128, max_new_tokens=1024, response_mean=256)
    longest = skewed.response_lengths(64)[-1]
    assert longest > 2 * 256 and skewed.response_lengths(64) == tuple(sorted(skewed.response_lengths(64)))
    layout = Layout((0,))
    t_skew = CostModel(LinearOps(Cluster.for_devices(1)), skewed).generate(cfg, layout, 64)
    t_even = CostModel(LinearOps(Cluster.for_devices(1)), even).generate(cfg, layout, 64)
    # the tail makes it slower than the mean alone, but far cheaper than everyone running to the tail
    assert t_even < t_skew
    full = Workload(prompts=64, prompt_tokens=128, max_new_tokens=1024, response_mean=round(longest))
    assert t_skew < CostModel(LinearOps(Cluster.for_devices(1)), full).generate(cfg, layout, 64)


def test_inference_and_training_time_by_hand():
    cfg = llama()
    cluster = Cluster.for_devices(2)
    w = Workload(prompts=16, prompt_tokens=300, max_new_tokens=200, response_mean=200, train_steps=2)
    costs = CostModel(LinearOps(cluster), w)
    tokens = 16 * 500
    # pp = 2, 4 micro-batches: (4 + 2 - 1) slots of the slowest stage, each with its p2p send
    layers = mem.stage_layer_count(cfg, 2)
    mb = tokens / 4
    send = cluster.intra_node_latency + mb * cfg.hidden_size * 2 / cluster.p2p_bandwidth
    heads = mb * 200 / 500  # the head runs at response tokens only
    stage = layers * 1e-6 * mb + 5e-7 * heads + send
    assert costs.inference(cfg, Layout.contiguous(pp=2), 4) == pytest.approx(5 * stage)
    # dp = 2, 2 micro-batches, 2 optimizer steps: per step the pipeline, each micro-batch's
    # gradients added into the buffer, the gradient all-reduce over the two replicas and the optimizer
    mb = math.ceil(16 / (2 * 2)) * 500 / 2
    stage = cfg.num_layers * 3e-6 * mb + 1.5e-6 * mb * 200 / 500
    params = mem.rank_params(cfg, 1, 1)
    grads = cluster.intra_node_latency + params * 4 / cluster.intra_node_bandwidth  # fp32; 2 (n - 1) / n = 1
    expected = 2 * (2 * stage + 2 * 3e-13 * params + grads + 1e-12 * params)
    assert costs.train(cfg, Layout.contiguous(dp=2), 2) == pytest.approx(expected)


def test_shared_prompts_run_a_groups_prompt_once():
    """4 prompts x 8 samples of 300 + 200 tokens: shared, the layers run 300 + 8 x 200 tokens a
    group instead of 8 x 500, and the head the same 8 x 200; attention runs over rows that hold
    each sample's prompt (8 x 500 key slots), with gathers."""
    cfg = llama()
    kw = dict(prompts=4, samples_per_prompt=8, prompt_tokens=300, max_new_tokens=200, response_mean=200)
    padded, shared = Workload(**kw), Workload(**kw, share_prompts=True)
    assert shared.model_tokens == pytest.approx((300 + 8 * 200) / 8) and padded.model_tokens == 500
    short = Workload(**{**kw, "prompt_tokens": 5}, share_prompts=True)  # 4.4 of 205 tokens: not shared
    assert short.model_tokens == short.mean_tokens
    costs = {w: CostModel(LinearOps(Cluster.for_devices(1)), w) for w in (padded, shared)}
    layout = Layout.contiguous()
    for w in (padded, shared):  # one micro-batch: layers on the model's tokens, the head on responses
        tokens, slots = 32 * w.model_tokens, 32 * 500
        packed = 1e-9 * (slots - tokens) * 500 + 1e-7 * slots if w.share_prompts else 0.0  # attention swapped
        assert costs[w].inference(cfg, layout, 1) == pytest.approx(
            cfg.num_layers * (1e-6 * tokens + packed) + 5e-7 * 32 * 200)
        backward = 2.5e-9 * (slots - tokens) * 500 + 1e-7 * slots if w.share_prompts else 0.0
        assert costs[w].train(cfg, layout, 1) == pytest.approx(
            cfg.num_layers * (3e-6 * tokens + packed + backward) + 1.5e-6 * 32 * 200
            + (3e-13 + 1e-12) * mem.rank_params(cfg, 1, 1))
    # a model with a sliding window shares nothing in the runtime: charged as the padded rows
    windowed = dataclasses.replace(cfg, sliding_windows=(64,) * cfg.num_layers)
    assert costs[shared].train(windowed, layout, 1) == pytest.approx(costs[padded].train(windowed, layout, 1))
    assert costs[shared].inference(windowed, layout, 1) == pytest.approx(costs[padded].inference(windowed, layout, 1))


def test_prompt_kv_sharing_reads_a_groups_prompt_once():
    """Every response N tokens, so every row stays to the end: with ``share_prompt_kv`` a row's
    attention reads an eighth of the prompt (groups of 8 samples) or 2/11 of it (11 samples: groups
    of 8 and 3), instead of all of it; under a sliding window it reads all of it."""
    cfg, P, N = llama(), 100, 41
    windowed = dataclasses.replace(cfg, sliding_windows=(64,) * cfg.num_layers)
    layout = Layout((0,))
    for samples, read in ((8, P / 8), (11, 2 * P / 11)):
        kw = dict(prompts=4, samples_per_prompt=samples, prompt_tokens=P, max_new_tokens=N, response_mean=N)
        m = 4 * samples
        own, shared = (CostModel(LinearOps(Cluster.for_devices(1)), Workload(**kw, share_prompt_kv=s))
                       for s in (False, True))
        saved = (N - 1) * cfg.num_layers * 1e-7 * m * (P - read)  # LinearOps: 1e-7 s per row x position
        assert own.generate(cfg, layout, m) - shared.generate(cfg, layout, m) == pytest.approx(saved)
        assert shared.generate(windowed, layout, m) == pytest.approx(own.generate(windowed, layout, m))
    # rows leaving: with 1 of 8 rows live, a group of 8 still reads its prompt unless all 8 left,
    # with probability (7/8)^8, so a live row reads P (1 - (7/8)^8) / 1 of the prompt's positions
    kw = dict(prompts=4, samples_per_prompt=8, prompt_tokens=P, max_new_tokens=N, response_mean=N)
    shared = CostModel(LinearOps(Cluster.for_devices(1)), Workload(**kw, share_prompt_kv=True))
    assert shared._read_context(cfg, 150.0, 4, 32) == pytest.approx(150 - P * (7 / 8) ** 8)


def test_tensor_parallel_adds_two_all_reduces_per_layer():
    cfg = llama()
    cluster = Cluster.for_devices(2)
    w = Workload(prompts=8, prompt_tokens=100, max_new_tokens=100, response_mean=100)
    costs = CostModel(LinearOps(cluster), w)
    mb = 8 * 200
    ar = cluster.intra_node_latency + 2 * (1 / 2) * mb * cfg.hidden_size * 2 / cluster.intra_node_bandwidth
    expected = cfg.num_layers * (1e-6 * mb / 2 + 2 * ar) + 5e-7 * mb / 2  # the head at the response half
    assert costs.inference(cfg, Layout.contiguous(tp=2), 1) == pytest.approx(expected)


def test_profile_tables_interpolate_and_override_the_roofline(tmp_path):
    t = Table((100.0, 200.0, 400.0), ((1.0, 2.0), (2.0, 4.0), (4.0, 8.0)), (10.0, 20.0))
    assert t(100, 10) == 1.0 and t(400, 20) == 8.0
    assert t(150, 15) == pytest.approx((1.5 + 3.0) / 2)  # bilinear inside
    assert t(800, 10) == pytest.approx(8.0)  # extrapolated linearly past the last point
    assert t(50, 10) == 1.0  # clamped below the first point
    cfg = llama()
    profile = Profile(device="test")
    from shardflow.perf.profile import HeadProfile, LayerProfile, layer_key

    flat = Table((1.0,), ((0.5,),), (1.0,))
    profile.layers[layer_key(cfg)] = {2: LayerProfile(forward=flat, backward=flat, decode=flat, optimizer_per_param=1e-9)}
    profile.save(tmp_path / "p.json")
    ops = OpCosts(Cluster.for_devices(8), Profile.load(tmp_path / "p.json"))
    assert ops.source(cfg, 2) == "measured" and ops.layer_forward(cfg, 2, 1000, 100) == 0.5
    # tp = 4 was not measured: the roofline, scaled by measured / roofline at tp = 2
    roof = OpCosts(Cluster.for_devices(8))
    assert ops.source(cfg, 4) == "calibrated"
    scale = 0.5 / roof.layer_forward(cfg, 2, 1000, 100)
    assert ops.layer_forward(cfg, 4, 1000, 100) == pytest.approx(roof.layer_forward(cfg, 4, 1000, 100) * scale)
    assert ops.source(llama(hidden=1024), 1) == "roofline"
    assert HeadProfile  # the head tables follow the same rules
    # without attention tables (an older profile) packed attention swaps the roofline's attention
    # at the tokens for its packed attention at the key slots
    swap = roof.roofline.packed_forward(layer_shape(cfg, 2), ops.cluster, 1200, 100) - \
        roof.roofline.attention_forward(layer_shape(cfg, 2), ops.cluster, 1000, 100)
    assert ops.packed_layer_forward(cfg, 2, 1000, 1200, 100) == pytest.approx(0.5 + swap)
    # with them, the measured ones (kept through the file)
    attention = Table((1000.0, 2000.0), ((0.1,), (0.2,)), (100.0,))
    packed = Table((1000.0, 2000.0), ((0.15,), (0.3,)), (100.0,))
    profile.layers[layer_key(cfg)] = {2: LayerProfile(
        forward=flat, backward=flat, decode=flat, optimizer_per_param=1e-9, attention_forward=attention,
        attention_backward=attention, packed_forward=packed, packed_backward=packed)}
    profile.save(tmp_path / "p.json")
    ops = OpCosts(Cluster.for_devices(8), Profile.load(tmp_path / "p.json"))
    assert ops.packed_layer_forward(cfg, 2, 1000, 1200, 100) == pytest.approx(0.5 - 0.1 + 0.18)
    assert ops.packed_layer_backward(cfg, 2, 1000, 1200, 100) == pytest.approx(0.5 - 0.1 + 0.18)


def test_rank_params_match_the_sharding_spec():
    for cfg in (tiny("llama"), tiny("qwen3", tie_word_embeddings=True), tiny("qwen2", num_hidden_layers=5),
                tiny("llama", value_head=True)):
        for pp in (1, 2, 3, 4):
            for tp in (1, 2, 4):
                layout = Layout.contiguous(pp=pp, tp=tp)
                brute = max(sum(t.numel() for t in shard_for(cfg, layout, layout.rank_at(s, 0, 0)).tensors.values())
                            for s in range(pp))
                assert mem.rank_params(cfg, pp, tp) == brute, (cfg.family, pp, tp)


@pytest.mark.parametrize("transposed", [False, True])
def test_decode_copy_bytes_match_the_copies_the_model_makes(transposed):
    import torch

    from shardflow.models.transformer import build_model
    for cfg in (tiny("llama"), tiny("qwen3", tie_word_embeddings=True)):
        for tp in (1, 2):
            model = build_model(cfg, shard_for(cfg, Layout.contiguous(tp=tp), 0), None, "cpu", torch.bfloat16)
            make_decode_weights(model, transposed)
            copies = [m for layer in model.model.layers.values()
                      for m in (layer.self_attn.decode_qkv, layer.mlp.decode_gate_up, layer.self_attn.o_proj.decode_weight,
                                layer.mlp.down_proj.decode_weight)] + [model.decode_head]
            made = sum(c.weight.numel() * c.weight.element_size() for c in copies if c is not None)
            assert mem.decode_copy_bytes(cfg, tp, mem.Precision(), transposed) == made, (cfg.family, tp)


def _masks(cfg: ModelConfig, layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """Which elements of each full checkpoint tensor a rank holds (a tied head counts as its source)."""
    out: dict[str, np.ndarray] = {}
    for t in shard_for(cfg, layout, rank).tensors.values():
        m = out.setdefault(t.source, np.zeros(t.full_shape, dtype=bool))
        m[t.full_slices()] = True
    return out


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen3", {"tie_word_embeddings": True}),
                                       ("llama", {"num_key_value_heads": 1})])
def test_received_bytes_equal_what_is_needed_minus_what_is_held(family, kw):
    cfg = tiny(family, **kw)
    pairs = [("d2p1t1@0-1", "d1p1t2@0-1"), ("d1p2t1@0-1", "d1p1t2@0-1"), ("d1p1t4@0-3", "d2p2t1@0-3"),
             ("d1p2t2@0-3", "d1p1t4@2-5"), ("d4p1t1@0-3", "d1p4t1@4-7"), ("d1p4t1@0-3", "d2p1t2@1-4")]
    for src_text, dst_text in pairs:
        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        for rank in dst.ranks:
            need = _masks(cfg, dst, rank)
            held = _masks(cfg, src, rank) if rank in src else {}
            brute = sum(int((m & ~held.get(name, np.zeros_like(m))).sum()) for name, m in need.items())
            assert received_bytes(cfg, src, dst, rank) == 2 * brute, (src_text, dst_text, rank)
            # what the reallocation engine's plan sends this rank (adaptive TP counts its switches so)
            sent = sum(t.numel for t in transfer_plan(cfg, src, dst).transfers if t.dst_rank == rank and not t.local)
            assert received_bytes(cfg, src, dst, rank) == 2 * sent, (src_text, dst_text, rank)


def test_reallocation_time_uses_the_links():
    cfg = llama()
    cluster = Cluster.for_devices(16)  # two nodes of 8
    a = Layout.contiguous(0, dp=8)
    assert realloc_seconds(cfg, a, a, cluster) == 0.0
    same_node = realloc_seconds(cfg, a, Layout.contiguous(0, tp=8), cluster)
    other_node = realloc_seconds(cfg, a, Layout.contiguous(8, tp=8), cluster)
    assert other_node > 5 * same_node  # everything crosses the slower inter-node links


def test_plans_that_do_not_fit_are_rejected():
    p = small_problem(devices=4)
    one = Layout((0,))
    crowded = (Choice(one), Choice(one, 1), Choice(one, 1))
    roomy = (Choice(Layout.contiguous(dp=4)), Choice(Layout.contiguous(tp=4), 2), Choice(Layout.contiguous(dp=4), 2))
    assert estimate(p, crowded).feasible
    need = estimate(p, crowded).peak_bytes["actor_train"]
    tight = small_problem(devices=4, memory_gb=need / 1e9)  # 90% of it is usable
    est = estimate(tight, crowded)
    assert not est.feasible and est.iteration_s == math.inf
    assert est.failed_call in ("actor_gen", "ref_inf", "actor_train") and "GB" in est.reason
    assert estimate(tight, roomy).feasible
    # a small KV-cache budget: fewer slots than requests, slower generation
    a = estimate(p, roomy)
    p.kv_cache_bytes = 0.25 * a.kv_slots["actor_gen"] * mem.kv_bytes_per_slot(p.models["actor"], 1, 768, p.precision)
    b = estimate(p, roomy)
    assert a.kv_slots["actor_gen"] == 32 and b.kv_slots["actor_gen"] == 8
    assert b.call_s["actor_gen"] > 1.5 * a.call_s["actor_gen"]
    # paged, the same budget holds sequences of the mean length in whole blocks, not of the longest
    p.kv_block_size = 64
    tokens = p.kv_tokens_per_sequence
    assert tokens % 64 == 0 and p.workload.mean_tokens <= tokens < min(p.workload.mean_tokens + 64, 768)
    c = estimate(p, roomy)
    assert c.kv_slots["actor_gen"] == min(32, int(p.kv_cache_bytes // mem.kv_bytes_per_slot(
        p.models["actor"], 1, tokens, p.precision))) > 8
    assert c.call_s["actor_gen"] < b.call_s["actor_gen"]
    p.kv_cache_bytes = 0.9 * mem.kv_bytes_per_slot(p.models["actor"], 1, 768, p.precision)  # not one whole sequence
    assert not estimate(p, roomy).feasible


def test_reallocation_time_by_brute_force():
    # Two nodes of 4: every destination rank gets what it lacks, from its node's source ranks over
    # NVLink where one holds it, else over the network; the slowest rank sets the time.
    cfg = tiny("llama", num_key_value_heads=4)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    pairs = [("d2p1t2@0-3", "d1p2t4@0-7"), ("d1p2t2@2-5", "d2p2t1@0-3"), ("d4p2t1@0-7", "d1p1t4@4-7"),
             ("d1p4t1@0-3", "d2p1t2@4-7"), ("d1p1t4@0-3", "d2p1t2@0,2,1,3"), ("d2p1t2@4,6,5,7", "d1p2t2@2-5")]
    for src_text, dst_text in pairs:
        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        worst = 0.0
        for rank in dst.ranks:
            need = _masks(cfg, dst, rank)
            own = _masks(cfg, src, rank) if rank in src else {}
            node = [r for r in src.ranks if cluster.node_of(r) == cluster.node_of(rank)]
            near: dict[str, np.ndarray] = {}
            for r in node:
                for name, m in _masks(cfg, src, r).items():
                    near[name] = near.get(name, np.zeros_like(m)) | m
            missing = sum(int((m & ~own.get(n, np.zeros_like(m))).sum()) for n, m in need.items())
            remote = sum(int((m & ~near.get(n, np.zeros_like(m))).sum()) for n, m in need.items())
            worst = max(worst, 2 * (missing - remote) / cluster.p2p_bandwidth + 2 * remote / cluster.inter_node_bandwidth)
        spans = cluster.node_of(min(src.ranks[0], dst.ranks[0])) != cluster.node_of(max(src.ranks[-1], dst.ranks[-1]))
        latency = cluster.inter_node_latency if spans else cluster.intra_node_latency
        assert realloc_seconds(cfg, src, dst, cluster) == pytest.approx(worst + latency), (src_text, dst_text)


def test_training_activations_by_hand_with_the_head_in_chunks():
    """Per token and layer the tensors backward keeps; the LM head one chunk of logits at a time
    (bf16 logits and their float32 gradient) plus each token's float32 hidden-state gradient."""
    p = mem.Precision()
    for vocab in (32000, 256000):
        cfg = llama(vocab=vocab)  # hidden 2048, 16 heads of 128 (q 2048), 8 KV heads (kv 1024), inter 5632
        stored = (4 * 2048 + 2 * 2048 + 2 * 1024 + 4 * 5632) * 2
        for tokens in (64, 8192, 30000):
            head = min(mem.CHUNK_ELEMENTS, tokens * vocab) * (2 + 4) + tokens * 2048 * 4
            assert mem.train_activation_bytes(cfg, Layout((0,)), tokens, 1, False, p) == \
                tokens * 16 * stored + head, (vocab, tokens)


def test_auto_micro_batch_tokens_are_the_most_that_fit():
    cfg, one, p = llama(), Layout((0,)), mem.Precision()
    step, share = mem.AUTO_TOKENS_STEP, mem.AUTO_MEMORY_SHARE

    def need(tokens, training=True, ckpt=False):
        if training:
            return mem.train_activation_bytes(cfg, one, tokens, 1, ckpt, p)
        return mem.inference_activation_bytes(cfg, one, tokens, p)

    seen = []
    for free_gb in (1, 5, 20, 40, 80):
        free = free_gb * 1e9
        tokens = mem.auto_micro_batch_tokens(cfg, one, free, training=True)
        assert tokens % step == 0 and step <= tokens <= mem.AUTO_MAX_TOKENS
        if tokens > step:
            assert need(tokens) <= share * free
        if tokens < mem.AUTO_MAX_TOKENS:
            assert need(tokens + step) > share * free, free_gb
        assert mem.auto_micro_batch_tokens(cfg, one, free, training=True, checkpointing=True) >= tokens
        assert mem.auto_micro_batch_tokens(cfg, one, free, training=False) >= tokens
        seen.append(tokens)
    assert seen == sorted(seen) and seen[0] == step and seen[-1] == mem.AUTO_MAX_TOKENS and len(set(seen)) >= 4


def test_unset_budget_is_sized_by_the_memory_the_model_leaves():
    roomy, tight = (small_problem(devices=4, memory_gb=gb) for gb in (141, 24))
    set_budget = small_problem(devices=4, memory_gb=141, micro_batch_tokens=4096)
    train, layout = roomy.calls[-1], Layout.contiguous(dp=4)
    free = 24e9 * 0.9 - tight.trained_state_bytes("actor", layout)
    assert tight.micro_batch_tokens(train, layout) == mem.auto_micro_batch_tokens(
        tight.models["actor"], layout, free, training=True)
    assert roomy.micro_batch_tokens(train, layout) == mem.AUTO_MAX_TOKENS > tight.micro_batch_tokens(train, layout)
    assert set_budget.micro_batch_tokens(train, layout) == 4096
    tokens = roomy.replica_sequences(train, layout) * roomy.workload.model_tokens_of(roomy.models["actor"])
    for problem in (roomy, tight, set_budget):
        assert problem.default_micro_batches(train, layout) == min(
            math.ceil(tokens / problem.micro_batch_tokens(train, layout)), problem.replica_sequences(train, layout))
