"""``shardflow plan`` and ``shardflow profile`` end to end on small inputs, and their bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from shardflow.cli.main import main
from shardflow.config.model import ModelConfig
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import OpCosts, Profile, layer_key
from shardflow.plan.execution_plan import ExecutionPlan
from shardflow.profiler.measure import measure_links
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.runtime.validate import check_config

SMALL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 32000}


@pytest.fixture
def experiment(tmp_path):
    for name, arch in (("policy", "LlamaForCausalLM"), ("value", "LlamaForSequenceClassification")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**SMALL, "architectures": [arch], "num_labels": 1}))
    config = {
        "algorithm": {"name": "ppo", "batch_size": 32, "kl": {"coef": 0.1}},
        "models": {"actor": {"path": "policy"}, "ref": {"path": "policy"}, "critic": {"path": "value"}},
        "data": {"path": "prompts.jsonl", "max_prompt_tokens": 256},
        "generation": {"max_new_tokens": 256},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_command_writes_a_valid_plan_and_a_picture(experiment, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", str(experiment), "--devices", "4", "--time-limit", "1", "--seed", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("actor_gen", "critic_train", "estimated iteration", "symmetric baseline", "heuristic baseline"):
        assert needle in text
    plan = ExecutionPlan.load(out / "plan.yaml")
    from shardflow.config.load import load_config

    config = load_config(experiment)
    models = {"actor": ModelConfig.from_pretrained(tmp_path / "policy"),
              "ref": ModelConfig.from_pretrained(tmp_path / "policy"),
              "critic": ModelConfig.from_pretrained(tmp_path / "value")}
    plan.validate(check_config(config).graph, models, 4)
    assert plan.notes["estimated_iteration_s"] > 0 and set(plan.notes["baselines_s"]) == {"symmetric", "heuristic"}
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_command_refuses_bad_input(experiment, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["plan", str(experiment), "--devices", "6", "--out", out]) == 2
    assert "6 devices cannot be planned" in capsys.readouterr().err
    assert main(["plan", str(experiment), "--devices", "12", "--out", out]) == 2
    assert "cannot be split into whole nodes of 8 GPUs" in capsys.readouterr().err
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 8192, "num_hidden_layers": 80,
                                                  "num_attention_heads": 64, "intermediate_size": 28672}))
    assert main(["plan", str(experiment), f"models.actor.path={big}", "--devices", "1", "--out", out]) == 2
    assert "model 'actor'" in capsys.readouterr().err
    assert main(["plan", str(experiment), "models.ref.path=nowhere", "--devices", "2", "--out", out]) == 2
    assert "models.ref.path: no config.json at" in capsys.readouterr().err


def test_unreachable_clusters_and_cyclic_graphs_are_named():
    with pytest.raises(ValueError, match="6 devices cannot be planned"):
        Cluster.for_devices(6)
    with pytest.raises(ValueError, match="gpus_per_node must be a power of two"):
        Cluster(gpus_per_node=6)
    with pytest.raises(ValueError, match="cycle among calls: gen, train"):
        Graph("loop", (Call("gen", Kind.GENERATE, "actor", ("weights",), ("responses",)),
                       Call("train", Kind.TRAIN, "actor", ("responses",), ("weights",))))


def test_profile_command_measures_a_small_shape(experiment, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 64, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "intermediate_size": 128,
                                                    "vocab_size": 256, "num_hidden_layers": 2}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "profile.json"
        assert main(["profile", "--model", str(model), "--quick", "--tp", "1,2,3", "--ranks", "0",
                     "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "tp=3: skipped" in capsys.readouterr().out
    profile = Profile.load(out)
    cfg = ModelConfig.from_pretrained(model)
    ops = OpCosts(profile.cluster(Cluster.for_devices(8)), profile)
    assert [ops.source(cfg, tp) for tp in (1, 2, 4)] == ["measured", "measured", "calibrated"]
    assert ops.layer_forward(cfg, 1, 128, 16) > 0 and ops.decode_layer(cfg, 2, 4, 64) > 0
    layer = profile.layers[layer_key(cfg)][2]  # attention alone, causal and packed, measured too
    tables = (layer.attention_forward, layer.attention_backward, layer.packed_forward, layer.packed_backward)
    assert all(t is not None and t(64, 16) > 0 for t in tables)
    assert profile.rates["matmul_flops"] > 0 and profile.rates["hbm_bandwidth"] > 0
    # planning with it uses its measured rates for the shapes it did not measure
    capsys.readouterr()
    assert main(["plan", str(experiment), "--devices", "2", "--time-limit", "0.5", "--profile", str(out),
                 "--out", str(tmp_path / "planned")]) == 0
    assert "(profile of cpu)" in capsys.readouterr().out


def test_profile_decodes_with_the_weights_the_engine_reads(tmp_path, monkeypatch):
    """--transposed-weights: the profiled decode layer reads transposed copies, as the engine does."""
    from shardflow.engine.generate import decode_weights
    from shardflow.profiler import measure

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 64, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "intermediate_size": 128,
                                                    "vocab_size": 256, "num_hidden_layers": 2}))
    layouts = []
    original = decode_weights.make_decode_weights

    def recording(model, transposed=False):
        original(model, transposed)
        layouts.append(decode_weights.decode_weights_layout(model))

    monkeypatch.setattr(measure, "make_decode_weights", recording)
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--quick", "--tp", "1", "--ranks", "0", "--transposed-weights",
                 "--out", str(out)]) == 0
    assert layouts == ["transposed"]


def test_link_measurement_over_ranks(pool, tmp_path):
    path = tmp_path / "links.json"
    pool.run(measure_links, str(path), (2**12, 2**16, 2**18), 2)
    rates = json.loads(path.read_text())
    assert set(rates) == {"intra_node_bandwidth", "intra_node_latency", "p2p_bandwidth"}
    assert all(v > 0 for v in rates.values())
    Cluster().with_rates(**rates)  # they are valid cluster rates
