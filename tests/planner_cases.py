"""Small planning problems shared by the planner tests (model shapes only, no weights)."""

from __future__ import annotations

from shardflow.config.model import ModelConfig
from shardflow.perf.hardware import Cluster
from shardflow.plan.problem import Problem
from shardflow.plan.workload import Workload
from shardflow.rl.graph import Call, Graph, Kind


def llama(hidden: int = 2048, layers: int = 16, heads: int = 16, kv: int = 8, inter: int = 5632,
          vocab: int = 32000, value_head: bool = False) -> ModelConfig:
    arch = "LlamaForSequenceClassification" if value_head else "LlamaForCausalLM"
    return ModelConfig.from_hf_dict({
        "architectures": [arch], "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab, "num_labels": 1,
    })


def tiny(family: str = "llama", value_head: bool = False, **overrides) -> ModelConfig:
    """A tiny model shape of a family (vocabulary 128, 4 layers, 4 heads, 2 KV heads)."""
    arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    raw = {"architectures": [arch + ("ForSequenceClassification" if value_head else "ForCausalLM")],
           "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_labels": 1, "tie_word_embeddings": False}
    if family == "qwen3":
        raw["head_dim"] = 16
    raw.update(overrides)
    return ModelConfig.from_hf_dict(raw)


def grpo_graph() -> Graph:
    return Graph("grpo", (
        Call("actor_gen", Kind.GENERATE, "actor", ("prompts",), ("responses",)),
        Call("reward_fn", Kind.FUNCTION, None, ("responses",), ("rewards",)),
        Call("ref_inf", Kind.INFERENCE, "ref", ("responses",), ("ref_logprobs",)),
        Call("actor_train", Kind.TRAIN, "actor", ("responses", "rewards", "ref_logprobs")),
    ))


def small_problem(devices: int = 4, memory_gb: float = 141, **workload) -> Problem:
    """GRPO with a reference model, ~1B-parameter models, on one node."""
    w = dict(prompts=32, samples_per_prompt=4, prompt_tokens=256, max_new_tokens=512, response_mean=256,
             response_std=128, train_steps=2)
    w.update(workload)
    return Problem(graph=grpo_graph(), models={"actor": llama(), "ref": llama()},
                   cluster=Cluster.for_devices(devices, memory_bytes=memory_gb * 1e9), workload=Workload(**w))
