"""Experiment config loading, the PPO/GRPO graphs, and execution-plan files."""

from __future__ import annotations

import pytest
import yaml

from shardflow.config.load import load_config
from shardflow.config.model import ModelConfig
from shardflow.models.tiny import tiny_hf_config
from shardflow.parallel.layout import Layout, merge_replicas, split_replicas
from shardflow.parallel.sharding import shard_for
from shardflow.plan.execution_plan import CallPlan, ExecutionPlan, check_merge, symmetric_plan
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.runtime.validate import check_config


@pytest.fixture
def base_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"models": {"actor": {"path": "m"}}, "data": {"path": "d.jsonl"},
                                    "generation": {"samples_per_prompt": 4}}))
    return path


def build_graph(config):
    """The graph of the algorithm ``config`` names, after the checks across settings."""
    return check_config(config).graph


def test_overrides_types_and_unknown_keys(base_file):
    cfg = load_config(base_file, ["algorithm.batch_size=16", "models.actor.optim.lr=1e-5", "generation.temperature=1"])
    assert cfg.algorithm.batch_size == 16 and cfg.models["actor"].optim.lr == 1e-5
    assert isinstance(cfg.generation.temperature, float)
    with pytest.raises(ValueError, match="unknown config key 'algorithm.batch_sise'; did you mean 'algorithm.batch_size'"):
        load_config(base_file, ["algorithm.batch_sise=3"])
    with pytest.raises(ValueError, match="'algorithm.batch_size' must be int, got 'abc'"):
        load_config(base_file, ["algorithm.batch_size=abc"])
    with pytest.raises(ValueError, match="algorithm.name must be one of ppo, grpo, .*, dpo; got 'kto'"):
        check_config(load_config(base_file, ["algorithm.name=kto"]))
    with pytest.raises(ValueError, match="models.critic is required"):
        check_config(load_config(base_file, ["algorithm.name=ppo"]))
    with pytest.raises(ValueError, match="config key 'algorithm.kl_coef' is now 'algorithm.kl.coef'"):
        load_config(base_file, ["algorithm.kl_coef=0.1"])
    with pytest.raises(ValueError, match="generation.compile_mode must be one of default, max-autotune-no-cudagraphs; "
                                         "got 'reduce-overhead'"):
        load_config(base_file, ["generation.compile_mode=reduce-overhead"])
    with pytest.raises(ValueError, match="generation.blas_library must be one of '', cublas, cublaslt; got 'mkl'"):
        load_config(base_file, ["generation.blas_library=mkl"])
    assert load_config(base_file, ["generation.blas_library=cublaslt"]).generation.blas_library == "cublaslt"
    with pytest.raises(ValueError, match="generation.kv_block_size must be a multiple of 16, got 24"):
        load_config(base_file, ["generation.kv_block_size=24"])


def test_offload_settings_name_the_model_they_do_not_fit(base_file):
    with_ref = ["algorithm.kl.coef=0.1", "models.ref.path=r"]
    with pytest.raises(ValueError, match="models.ref.offload_optimizer: ref is not trained here"):
        check_config(load_config(base_file, with_ref + ["models.ref.offload_optimizer=true"]))
    with pytest.raises(ValueError, match="models.actor.offload is for frozen models; actor is trained .* "
                                         "models.actor.offload_optimizer"):
        check_config(load_config(base_file, ["models.actor.offload=true"]))
    checked = check_config(load_config(base_file, with_ref + ["models.actor.offload_optimizer=true",
                                                              "models.ref.offload=true"]))
    assert checked.config.models["actor"].offload_optimizer


def test_graphs_of_ppo_and_grpo(base_file):
    ppo = build_graph(load_config(base_file, ["algorithm.name=ppo", "algorithm.kl.coef=0.1", "models.critic.path=c",
                                              "models.ref.path=r"]))
    assert [c.name for c in ppo.order] == ["actor_gen", "reward_fn", "ref_inf", "critic_inf", "actor_train",
                                          "critic_train"]
    assert ppo.trained_models() == ("actor", "critic")
    assert ppo.dependencies(ppo.call("actor_train")) == ["actor_gen", "reward_fn", "ref_inf", "critic_inf"]
    grpo = build_graph(load_config(base_file))
    assert [c.name for c in grpo.order] == ["actor_gen", "reward_fn", "actor_train"]


def test_graph_errors_name_the_problem():
    with pytest.raises(ValueError, match="cycle among calls: a, b"):
        Graph("g", (Call("a", Kind.INFERENCE, "m", ("y",), ("x",)), Call("b", Kind.INFERENCE, "m", ("x",), ("y",))))
    with pytest.raises(ValueError, match="reads 'z', which no call or data source provides"):
        Graph("g", (Call("a", Kind.INFERENCE, "m", ("z",), ("x",)),))


def model() -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_hf_config("llama").to_dict())


def test_plan_round_trip_and_validation(base_file):
    graph = build_graph(load_config(base_file, ["algorithm.kl.coef=0.1", "models.ref.path=r"]))
    models = {"actor": model(), "ref": model()}
    plan = symmetric_plan(graph, 4, tp=2)
    plan.validate(graph, models, 4)
    again = ExecutionPlan.from_dict(yaml.safe_load(plan.to_yaml()))
    assert again.calls == plan.calls
    with pytest.raises(ValueError, match="uses device\\(s\\) \\[2, 3\\] but only 2 exist"):
        plan.validate(graph, models, 2)
    partial = ExecutionPlan({k: v for k, v in plan.calls.items() if k != "ref_inf"})
    with pytest.raises(ValueError, match="does not cover call\\(s\\) \\['ref_inf'\\]"):
        partial.validate(graph, models, 4)
    bad = ExecutionPlan({**plan.calls, "ref_inf": CallPlan(layout=Layout.contiguous(tp=3))})
    with pytest.raises(ValueError, match="call 'ref_inf' \\(ref\\): tp=3 cannot split 4 attention heads"):
        bad.validate(graph, models, 4)


def test_adaptive_targets_must_merge_replicas():
    final = Layout.parse("d1p1t4@0-3")
    middle = split_replicas(final, 2)
    start = split_replicas(middle, 2)
    assert str(middle) == "d2p1t2@0,2,1,3" and merge_replicas(middle, 2) == final
    check_merge(start, middle)
    check_merge(middle, final)
    check_merge(start, final)
    with pytest.raises(ValueError, match="start from d2p1t2@0,2,1,3"):
        check_merge(Layout.parse("d2p1t2@0-3"), final)
    with pytest.raises(ValueError, match="not reachable"):
        check_merge(Layout.parse("d2p1t2@0-3"), Layout.parse("d2p1t2@4-7"))


def test_merged_layouts_nest_every_shard():
    """After a merge each rank holds a sub-range of every tensor it held before."""
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama", num_attention_heads=8, num_key_value_heads=2,
                                                  vocab_size=130).to_dict())
    final = Layout.contiguous(tp=8)
    chain = [split_replicas(final, 8), split_replicas(final, 4), split_replicas(final, 2), final]
    for src, dst in zip(chain, chain[1:]):
        for rank in final.ranks:
            before, after = shard_for(cfg, src, rank).tensors, shard_for(cfg, dst, rank).tensors
            for name, ts in after.items():
                old = before[name]
                if ts.dim is not None:
                    assert old.start <= ts.start and ts.stop <= old.stop, (str(src), str(dst), rank, name)


def test_what_a_run_keeps_in_host_memory_is_checked_before_it_starts(base_file):
    """Offloaded optimizer state (12 bytes per parameter) and offloaded frozen weights (their dtype's
    bytes: float32 here) over all ranks must fit in 90% of the host's available memory."""
    import torch

    from shardflow.plan.memory import rank_params
    from shardflow.runtime.validate import check_host_memory

    config = load_config(base_file, ["algorithm.kl.coef=0.1", "models.ref.path=r",
                                     "models.actor.offload_optimizer=true", "models.ref.offload=true"])
    graph = build_graph(config)
    model = ModelConfig.from_hf_dict(tiny_hf_config("llama").to_dict())
    plan = symmetric_plan(graph, 1)
    needed = 12 * rank_params(model, 1, 1) + 4 * rank_params(model, 1, 1)
    cpu = torch.device("cpu")
    check_host_memory(config, graph, {"actor": model, "ref": model}, plan, cpu, int(needed / 0.9) + 1)
    check_host_memory(config, graph, {"actor": model, "ref": model}, plan, cpu, None)  # unknown: not checked
    with pytest.raises(ValueError, match=r"host memory: the run would keep .* GiB there \(models.actor."
                                         r"offload_optimizer .* GiB, models.ref.offload .* GiB\)"):
        check_host_memory(config, graph, {"actor": model, "ref": model}, plan, cpu, needed)
