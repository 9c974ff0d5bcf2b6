"""Adaptive TP decision logic without processes: length predictor, step-time and switch-cost
models, the policy on synthetic profiles where the right answer is known, simulated timelines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardflow.config.experiment import AdaptiveConfig
from shardflow.config.model import ModelConfig
from shardflow.engine.adaptive.length_predictor import LengthPredictor
from shardflow.engine.adaptive.merge import plan_merge
from shardflow.engine.adaptive.simulate import SimRequest, simulate
from shardflow.engine.adaptive.switch_cost import CostParams, SwitchCostModel
from shardflow.engine.adaptive.switch_policy import Decider, Loads, bucket_edges, bucket_sums
from shardflow.parallel.layout import Layout
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import OpCosts
from shardflow.perf.roofline import head_shape, layer_shape
from shardflow.perf.step_time import OpStepTime, StepTable, TableStepTime, roofline_steps

D2T1, D1T2 = Layout.parse("d2p1t1@0-1"), Layout.parse("d1p1t2@0-1")
CHAIN4 = [Layout.parse("d4p1t1@0,2,1,3"), Layout.parse("d2p1t2@0,2,1,3"), Layout.parse("d1p1t4@0-3")]


def llama8b() -> ModelConfig:
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)
    hf.architectures = ["LlamaForCausalLM"]
    return ModelConfig.from_hf_dict(hf.to_dict())


CFG = llama8b()


class Synthetic:
    """Per replica and step: tp=1 10 ms + 0.1 ms per request, tp=2 6 + 0.2, tp=4 4 + 0.4 (wider tp
    reads fewer weights per GPU but pays more per request); prefills free. With B requests spread
    over the replicas: d2t1 beats d1t2 above ~27 requests; d4t1 beats d2t2 above ~53, d2t2 beats
    d1t4 above ~7."""

    base = {1: 10e-3, 2: 6e-3, 4: 4e-3}
    per = {1: 0.1e-3, 2: 0.2e-3, 4: 0.4e-3}

    def decode(self, tp, batch, context):
        return self.base[tp] + self.per[tp] * np.asarray(batch, dtype=np.float64)

    def prefill(self, tp, tokens, context):
        return 0.0


def policy_sim(lengths, chain, *, history=None, slots=64, interval=32, **kw):
    steps = Synthetic()
    costs = SwitchCostModel(CFG, steps, params=CostParams(overhead_s=0.005))
    predictor = LengthPredictor(max_len=max(lengths))
    for past in history or [lengths, lengths]:
        predictor.observe(past)
    decider = Decider(cfg=CFG, chain=chain, steps=steps, costs=costs, predictor=predictor,
                      config=AdaptiveConfig(interval=interval, **kw))
    requests = [SimRequest(100, int(n)) for n in lengths]
    adaptive = simulate(requests, chain, slots=slots, steps=steps, costs=costs, decider=decider, interval=interval)
    static = {str(layout): simulate(requests, [layout], slots=slots, steps=steps, costs=costs).seconds
              for layout in chain}
    return adaptive, static, requests, steps, costs


# ----- the length predictor ---------------------------------------------------------------------

def test_predictor_prior_empirical_and_conditioning():
    p = LengthPredictor(max_len=1000, prior_weight=1.0)
    np.testing.assert_allclose(p.survival(np.array([0, 250, 1000, 2000])), [1, 0.75, 0, 0])
    p = LengthPredictor(max_len=1000, prior_weight=0.0)
    p.observe([100] * 5 + [300] * 5)
    np.testing.assert_allclose(p.survival(np.array([99, 100, 299, 300])), [1, 0.5, 0.5, 0])
    # having generated 150 tokens, a request is one of the 300s: 150 more steps, then done
    np.testing.assert_allclose(p.still_running(np.array([150]), np.array([0, 149, 150]))[0], [1, 1, 0])
    np.testing.assert_allclose(p.expected_remaining(np.array([0, 150])), [200, 150])
    # longer than every sample: the prior alone (uniform over what the limit leaves)
    np.testing.assert_allclose(p.still_running(np.array([600]), np.array([0, 200]))[0], [1, 0.5])


def test_predictor_keeps_recent_iterations_and_round_trips():
    p = LengthPredictor(max_len=100, max_samples=10)
    for value in (10, 20, 30):
        p.observe([value] * 5)
    assert p.num_samples == 10 and p.survival(np.array([15]))[0] == pytest.approx((10 * 1 + 0.85) / 11)
    q = LengthPredictor(max_len=1)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    np.testing.assert_array_equal(q.survival(np.arange(100)), p.survival(np.arange(100)))


def test_predictor_improves_as_the_run_goes_on():
    rng = np.random.default_rng(0)
    truth = np.minimum(rng.lognormal(np.log(500), 1.0, 200_000), 4000).round()
    grid = np.arange(0, 4000, 50)
    true_survival = (truth[None, :] > grid[:, None]).mean(1)
    p = LengthPredictor(max_len=4000)
    errors = []
    for _ in range(8):
        p.observe(rng.choice(truth, 128))
        errors.append(np.abs(p.survival(grid) - true_survival).max())
    assert errors[-1] < errors[0] / 2 and errors[-1] < 0.08


# ----- step time and switch cost ----------------------------------------------------------------

def test_roofline_decode_step_by_hand():
    """A step is every layer's step, the head, and tp's collectives; at batch 1 a layer reads its
    weights once, at a large batch it is bound by the matrix rate."""
    cluster = Cluster()
    steps = roofline_steps(CFG, cluster)
    roof, hbm, L = steps.ops.roofline, cluster.hbm_bandwidth, CFG.num_layers
    one, wide = layer_shape(CFG, 1), layer_shape(CFG, 2)

    def elementwise(shape, batch):
        return batch * roof._elementwise_elems(shape) * 2 / hbm

    layer = one.params * 2 / hbm + elementwise(one, 1) + cluster.layer_overhead_s  # context 0: no KV read
    head = roof.head_forward(head_shape(CFG, 1), cluster, 1)
    assert head == pytest.approx(CFG.vocab_size * 4096 * 2 / hbm + (4 * 4096 * 2 + 3 * 4 * CFG.vocab_size) / hbm
                                 + cluster.layer_overhead_s)
    assert steps.decode(1, np.array([1]), np.array([0]))[0] == pytest.approx(L * layer + head)
    kv = 1000 * CFG.kv_bytes_per_token(2) / hbm  # one request of 1000 tokens, every layer's keys and values
    assert steps.decode(1, np.array([1]), np.array([1000]))[0] == pytest.approx(L * layer + head + kv)
    ring = cluster.intra_node_latency + 4096 * 2 / cluster.intra_node_bandwidth  # 2 (n - 1) / n = 1 at tp=2
    half = wide.params * 2 / hbm + elementwise(wide, 1) + cluster.layer_overhead_s
    head2 = roof.head_forward(head_shape(CFG, 2), cluster, 1)
    assert steps.decode(2, np.array([1]), np.array([0]))[0] == pytest.approx(L * half + head2 + (2 * L + 1) * ring)
    B = 8192  # compute-bound
    big = 2 * B * one.params / (cluster.matmul_flops * roof.matmul_efficiency) + elementwise(one, B) \
        + cluster.layer_overhead_s
    assert steps.decode(1, np.array([B]), np.array([0]))[0] == pytest.approx(
        L * big + roof.head_forward(head_shape(CFG, 1), cluster, B))


def test_the_planner_costs_decode_steps_with_the_same_model():
    from planner_cases import small_problem

    problem = small_problem()
    cfg = problem.models["actor"]
    layout = Layout.contiguous(tp=2)
    steps = OpStepTime(cfg, OpCosts(problem.cluster, problem.profile))
    assert problem.costs.decode_step(cfg, layout, 12, 300) == pytest.approx(steps.decode(2, 12, 300))
    assert problem.costs.steps(cfg).decode(2, np.array([3, 12]), np.array([50, 300]))[1] == pytest.approx(
        steps.decode(2, 12, 300))


def test_measured_tables_interpolate_and_fall_back(tmp_path):
    roofline = roofline_steps(CFG)
    table = StepTable((1, 9), (0, 1000), ((1.0, 2.0), (3.0, 5.0)))
    assert table(np.array([1, 9, 5]), np.array([0, 1000, 500])).tolist() == [1.0, 5.0, 2.75]
    assert table(np.array([17]), np.array([0]))[0] == 5.0  # linear beyond the grid
    steps = TableStepTime({1: table}, roofline)
    ratio = 1.0 / roofline.decode(1, np.array([1]), np.array([0]))[0]
    assert steps.decode(2, np.array([1]), np.array([0]))[0] == pytest.approx(
        roofline.decode(2, np.array([1]), np.array([0]))[0] * ratio)
    with_comm = TableStepTime({1: table, 2: table}, roofline, add_comm=True)
    one = (np.array([1]), np.array([0]))
    assert with_comm.decode(2, *one)[0] == pytest.approx(1.0 + roofline.comm(2, np.array([1]))[0])
    assert with_comm.prefill(2, 1000, 100) == roofline.prefill(2, 1000, 100)  # not measured: the roofline
    with_comm.prefill_per_token[2] = 1e-5
    assert with_comm.prefill(2, 1000, 100) == pytest.approx(1e-2 + roofline.comm(2, np.array(1000)))
    with_comm.save(tmp_path / "steps.json")
    loaded = TableStepTime.load(tmp_path / "steps.json", roofline)
    assert loaded.tables == with_comm.tables and loaded.add_comm and loaded.prefill_per_token == {2: 1e-5}
    (tmp_path / "bad.json").write_text('{"format": "shardflow-decode-steps/1", "tables": {"1": {"batches": [2, 1]}}}')
    with pytest.raises(ValueError, match="bad.json is malformed"):
        TableStepTime.load(tmp_path / "bad.json", roofline)


def test_switch_cost_by_part():
    steps, hw = roofline_steps(CFG), Cluster()
    costs = SwitchCostModel(CFG, steps, hw, CostParams(graph_capture_s=0.01, overhead_s=0.002, round_latency_s=0.0))
    merge = plan_merge(D2T1, D1T2)
    per_token = 2 * 32 * 4 * 128 * 2  # keys and values, 4 of 8 KV heads per rank after the merge
    # replica 1's 3 requests of 2000 tokens go to rank 0: the busiest rank
    seconds, nbytes = costs.migrate_seconds(merge, [1, 3], [500, 2000])
    assert nbytes == 3 * 2000 * per_token and seconds == pytest.approx(nbytes / hw.p2p_bandwidth)
    assert costs.recompute_seconds(merge, [1, 3], [500, 2000]) == pytest.approx(steps.prefill(2, 6500, 1625))
    cost = costs.estimate(merge, [1, 3], [500, 2000], new_graphs=3)
    assert cost.kv_mode == "migrate" and cost.graphs_s == pytest.approx(0.03) and cost.weights_s == 0
    assert cost.total == pytest.approx(seconds + 0.03 + 0.002)
    assert costs.estimate(merge, [1, 3], [500, 2000], modes=("recompute",)).kv_mode == "recompute"
    assert costs.estimate(merge, [1, 3], [500, 2000], modes=()) is None
    slow_links = SwitchCostModel(CFG, steps, Cluster(p2p_bandwidth=1e6))
    assert slow_links.estimate(merge, [1, 3], [500, 2000]).kv_mode == "recompute"


# ----- the policy on synthetic profiles ---------------------------------------------------------

def test_simulated_static_timeline_by_hand():
    steps = Synthetic()
    costs = SwitchCostModel(CFG, steps)
    result = simulate([SimRequest(100, 1000)] * 64, [D2T1], slots=64, steps=steps, costs=costs)
    assert result.seconds == pytest.approx(999 * (10e-3 + 32 * 0.1e-3))  # prefill gives the first token
    assert result.active[:999] == [64] * 999 and result.switches == []


def test_no_switch_when_lengths_are_uniform():
    adaptive, static, *_ = policy_sim([1000] * 64, [D2T1, D1T2])
    assert adaptive.switches == []
    assert adaptive.seconds == pytest.approx(static[str(D2T1)]) and static[str(D2T1)] < static[str(D1T2)]


def test_an_early_switch_when_one_request_dominates():
    """63 requests end at 1500 tokens, one runs to 4000: d2t1 while the batch is large, d1t2 for the
    tail, switched at the first decision point after the 63 end."""
    lengths = [1500] * 63 + [4000]
    adaptive, static, requests, steps, costs = policy_sim(lengths, [D2T1, D1T2])
    [switch] = adaptive.switches
    assert switch["target"] == str(D1T2) and 1500 <= switch["step"] <= 1500 + 32
    hindsight = min(simulate(requests, [D2T1, D1T2], slots=64, steps=steps, costs=costs,
                             schedule={s: D1T2}).seconds for s in range(0, 4000, 64))
    assert adaptive.seconds < 0.85 * min(static.values()) and adaptive.seconds <= 1.05 * hindsight


def test_a_switch_at_once_when_a_replica_has_nothing_to_do():
    adaptive, static, *_ = policy_sim([5, 3000], [D2T1, D1T2])  # replica 0 ends almost at once
    assert [s["step"] for s in adaptive.switches] == [0]
    assert adaptive.seconds == pytest.approx(static[str(D1T2)] + adaptive.switches[0]["cost_s"])


def test_two_switches_down_a_chain():
    """64 requests, 24 from step 100, 4 from step 400: d4t1, then d2t2, then d1t4, each switch at
    the decision point (every 32 steps) nearest the change."""
    lengths = [100] * 40 + [400] * 20 + [3000] * 4
    adaptive, static, *_ = policy_sim(lengths, CHAIN4, slots=64)
    assert [(s["source"], s["target"]) for s in adaptive.switches] == [
        (str(CHAIN4[0]), str(CHAIN4[1])), (str(CHAIN4[1]), str(CHAIN4[2]))]
    first, second = (s["step"] for s in adaptive.switches)
    assert abs(first - 100) <= 16 and abs(second - 400) <= 16
    assert adaptive.seconds < 0.9 * min(static.values())


def test_decision_inputs_do_not_grow_with_the_batch():
    edges = bucket_edges(16384, 32)
    few = bucket_sums([10, 2000], [110, 2100], edges)
    many = bucket_sums(list(range(10_000)), list(range(100, 10_100)), edges)
    assert few.shape == many.shape == (3, len(edges)) and many[0].sum() == 10_000
    loads = Loads.from_sums(many[0][None], many[1][None], many[2][None])
    assert loads.counts.shape == (1, len(edges))


def test_policy_config_checks():
    with pytest.raises(ValueError, match="interval must be positive"):
        AdaptiveConfig(interval=0)
    with pytest.raises(ValueError, match="kv_mode must be"):
        Decider(cfg=CFG, chain=[D2T1], steps=Synthetic(), costs=None, predictor=LengthPredictor(max_len=4),
                config=AdaptiveConfig(), kv_mode="copy")
