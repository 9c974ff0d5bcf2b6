"""Plan search: the space, MCMC against exhaustive search, baselines, plan files."""

from __future__ import annotations

import pytest
import yaml
from planner_cases import grpo_graph, llama, small_problem

from shardflow.perf.hardware import Cluster
from shardflow.plan.baselines import heuristic, symmetric
from shardflow.plan.estimate import estimate, from_execution_plan, to_execution_plan
from shardflow.plan.execution_plan import ExecutionPlan
from shardflow.plan.problem import Problem
from shardflow.plan.search import SearchOptions, exhaustive, mcmc
from shardflow.plan.space import Space, device_sets
from shardflow.plan.workload import Workload


def test_device_sets_follow_nodes():
    sets = device_sets(Cluster(num_nodes=2, gpus_per_node=4))
    node0 = [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (2, 2), (0, 4)]
    node1 = [(s + 4, n) for s, n in node0]
    assert sorted(sets) == sorted(node0 + node1 + [(0, 8)])


def test_layouts_keep_tp_in_a_node_and_generation_unpipelined():
    p = small_problem(devices=8)
    space = Space(p)
    gen, _, train = p.calls
    assert all(pp == 1 for pp, _, _ in space.shapes(gen, 8))
    assert {tp for _, _, tp in space.shapes(train, 8)} == {1, 2, 4, 8}
    assert any(pp > 1 for pp, _, _ in space.shapes(train, 8))
    wide = Problem(graph=grpo_graph(), models={"actor": llama(), "ref": llama()},
                   cluster=Cluster(num_nodes=4, gpus_per_node=2), workload=p.workload)
    assert max(tp for _, _, tp in Space(wide).shapes(wide.calls[2], 8)) == 2


@pytest.fixture(scope="module")
def small():
    """A space small enough to enumerate (one micro-batch count), where memory forces the
    reference model into its own layout. The symmetric plans split their calls by a fixed token
    budget (sized by memory, they would take micro-batch counts this space leaves out)."""
    problem = small_problem(devices=4, memory_gb=30, micro_batch_tokens=8192)
    space = Space(problem, micro_batches=(1,))
    return problem, space, exhaustive(space)


def test_mcmc_finds_the_exhaustive_optimum_from_several_seeds(small):
    problem, space, best = small
    assert best.steps == space.count()
    assert best.estimate.feasible
    sym = symmetric(problem)
    assert best.estimate.iteration_s < 0.95 * sym[1].iteration_s  # the optimum is not the trivial plan
    for seed in range(3):
        found = mcmc(space, [], SearchOptions(time_limit_s=3.0, seed=seed, chains=2))  # random starts
        assert found.seconds < 2 * 3.0  # stops at the limit (slack for a loaded machine)
        assert found.estimate.iteration_s <= 1.02 * best.estimate.iteration_s, seed


def test_mcmc_is_reproducible_and_accepts_worse_plans(small):
    problem, space, _ = small
    opts = SearchOptions(time_limit_s=60, max_steps=150, seed=7, chains=2)
    a, b = mcmc(space, [], opts), mcmc(space, [], opts)
    assert a.plan == b.plan and a.steps == b.steps == 300 and a.history == b.history
    assert a.accepted_worse > 0  # the temperature lets chains climb out of local minima


def test_search_never_loses_to_its_starting_baselines():
    p = small_problem(devices=8, memory_gb=40)
    space = Space(p)
    base = [b for b in (symmetric(p), heuristic(p)) if b is not None]
    assert base
    found = mcmc(space, [b[0] for b in base], SearchOptions(time_limit_s=2.0, seed=0))
    assert found.estimate.iteration_s <= min(b[1].iteration_s for b in base)


def test_baselines_have_their_shape():
    p = small_problem(devices=8)
    plan, est = symmetric(p)
    assert est.feasible and all(c.layout.ranks == tuple(range(8)) for c in plan)
    gen, others = plan[0].layout, {c.layout for c in plan[1:]}
    assert len(others) == 1  # one layout; generation folds its pp into dp
    (other,) = others
    assert (gen.pp, gen.dp, gen.tp) == (1, other.pp * other.dp, other.tp)
    plan, est = heuristic(p)
    assert est.feasible and all(c.layout.ranks == tuple(range(8)) for c in plan)
    train = plan[p.index["actor_train"]]
    assert plan[p.index["actor_gen"]].layout.pp == 1 and train.micro_batches >= train.layout.pp


def test_plan_files_validate_and_round_trip(small):
    problem, _, best = small
    file_plan = to_execution_plan(problem, best.plan, best.estimate, {"estimated_iteration_s": 1.0})
    file_plan.validate(problem.graph, problem.models, problem.cluster.num_devices)
    again = ExecutionPlan.from_dict(yaml.safe_load(file_plan.to_yaml()))
    assert from_execution_plan(problem, again) == best.plan
    assert again["actor_train"].estimated_s == pytest.approx(best.estimate.call_s["actor_train"], rel=1e-5)
    assert estimate(problem, from_execution_plan(problem, again)).iteration_s == best.estimate.iteration_s


def test_exhaustive_refuses_a_large_space():
    space = Space(small_problem(devices=8))
    with pytest.raises(ValueError, match="plan space holds .* more than the 1000 exhaustive search"):
        exhaustive(space, max_plans=1000)


def test_a_model_that_fits_nowhere_is_named():
    huge = llama(hidden=8192, layers=80, heads=64, kv=8, inter=28672)
    p = Problem(graph=grpo_graph(), models={"actor": huge, "ref": llama()}, cluster=Cluster.for_devices(2),
                workload=Workload(prompts=8, prompt_tokens=128, max_new_tokens=128, response_mean=64))
    with pytest.raises(ValueError, match="call 'actor_train': model 'actor' .* does not fit on any device set"):
        Space(p)


def test_the_sharded_optimizer_opens_data_parallel_training_layouts():
    """A 7B-class model trained on 8 devices of 60 GB: pure data parallelism holds the whole
    model's optimizer state per rank and does not fit; with the optimizer sharded over the 8
    replicas it does (estimated memory, before any search)."""
    from shardflow.plan.memory import Precision, Shape, trained_state_bytes

    big = llama(hidden=4096, layers=32, heads=32, kv=8, inter=11008)
    p = Precision()
    whole, split = (trained_state_bytes(big, Shape(1, 8, 1), p, sharded=s) for s in (False, True))
    assert split == pytest.approx(whole * (2 + 4 + 12 / 8) / 18)
    workload = Workload(prompts=8, prompt_tokens=128, max_new_tokens=128, response_mean=64)

    def train_shapes(sharded: bool):
        problem = Problem(graph=grpo_graph(), models={"actor": big, "ref": big},
                          cluster=Cluster.for_devices(8, memory_bytes=60e9), workload=workload,
                          shard_optimizer={"actor": sharded})
        return Space(problem).shapes(problem.calls[2], 8)

    assert (1, 8, 1) not in train_shapes(False)
    assert (1, 8, 1) in train_shapes(True)


def test_an_offloaded_optimizer_fits_a_model_on_one_device_and_costs_host_traffic():
    """A 7B-class model with its reference on one 80 GB device: weights, gradients and optimizer
    state (18 bytes per parameter) do not fit; with the optimizer state in host memory (6 bytes
    per parameter on the device) the GRPO plan does. The offloaded step costs at least the state's
    trip over the host link."""
    from shardflow.parallel.layout import Layout
    from shardflow.plan.memory import Precision, Shape, rank_params, trained_state_bytes

    big = llama(hidden=4096, layers=32, heads=32, kv=8, inter=11008)
    p = Precision()
    params = rank_params(big, 1, 1)
    assert trained_state_bytes(big, Shape(1, 1, 1), p, offloaded=True) == params * 6 + p.offload_buffer_bytes
    workload = Workload(prompts=8, prompt_tokens=128, max_new_tokens=128, response_mean=64)

    def problem(offloaded: bool) -> Problem:
        return Problem(graph=grpo_graph(), models={"actor": big, "ref": big},
                       cluster=Cluster.for_devices(1, memory_bytes=80e9), workload=workload,
                       offload_optimizer={"actor": offloaded}, checkpointing={"actor": True})

    with pytest.raises(ValueError, match="model 'actor' .* does not fit on any device set"):
        Space(problem(False))
    offloaded = problem(True)
    assert (1, 1, 1) in Space(offloaded).shapes(offloaded.calls[2], 1)
    plan, est = symmetric(offloaded)
    assert est.feasible and estimate(offloaded, plan).feasible
    costs, layout = offloaded.costs, Layout.contiguous()
    plain, streamed = (costs.train(big, layout, 4, True, offloaded=o) for o in (False, True))
    steps = workload.train_steps
    assert streamed >= plain and streamed >= steps * params * 12 / offloaded.cluster.host_bandwidth
