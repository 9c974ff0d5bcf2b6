"""HF checkpoint I/O: sharded files, save-after-load identity, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from shardflow.config.model import ModelConfig
from shardflow.models.checkpoint import CheckpointReader, load_model, save_checkpoint
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import check_layout, shard_for


def all_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def save_job(world, src: str, layout_text: str, dst: str):
    layout = Layout.parse(layout_text)
    world.create_groups([layout])
    if world.rank not in layout:
        return None
    model, _ = load_model(src, layout, world)
    save_checkpoint(model, model.cfg, layout, world.rank, dst, tokenizer_dir=src, max_shard_bytes=60_000)
    return None


@pytest.mark.parametrize("case,layout", [
    ("qwen2_pad", "d1p1t4@0-3"),  # vocab padding and KV heads replicated over tp
    ("llama_tied", "d2p2t2@0-7"),  # tied head copied onto the last stage
    ("qwen3_value", "d1p2t2@0-3"),
])
def test_save_after_load_is_identical(pool, checkpoints, tmp_path, case, layout):
    family = {"qwen2_pad": "qwen2", "llama_tied": "llama", "qwen3_value": "qwen3"}[case]
    kwargs = {"qwen2_pad": dict(vocab_size=130), "llama_tied": dict(tie_word_embeddings=True),
              "qwen3_value": dict(value_head=True)}[case]
    src = checkpoints.get(case, family, **kwargs)
    dst = tmp_path / "saved"
    pool.run(save_job, src, layout, str(dst))

    original, saved = all_tensors(src), all_tensors(dst)
    assert sorted(saved) == sorted(original)
    for name, t in original.items():
        assert torch.equal(saved[name], t), name
    assert (dst / "model.safetensors.index.json").is_file()  # small shards force an index
    assert (dst / "tokenizer.json").is_file()

    auto = transformers.AutoModelForSequenceClassification if "value" in case else transformers.AutoModelForCausalLM
    ids = torch.randint(3, 100, (2, 12))
    with torch.no_grad():
        a = auto.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = auto.from_pretrained(dst, dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)


def logits_job(world, path: str, layout_text: str, ids: torch.Tensor):
    from test_model_parity import forward_job

    return forward_job(world, path, [layout_text], ids)


def test_loads_sharded_checkpoint_with_index(pool, tmp_path):
    from shardflow.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    ids = torch.randint(3, 100, (2, 10))
    results = pool.run(logits_job, str(path), "d1p2t2@0-3", ids)
    [(rows, out)] = [r["d1p2t2@0-3"] for r in results if r]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], ref(ids).logits, atol=2e-5, rtol=0)


# ----- bad input: one clear line naming the problem ----------------------------------------


def test_unknown_architecture_is_named(checkpoints, tmp_path):
    path = Path(checkpoints.get("llama", "llama"))
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_hf_dict(raw)


def test_unsupported_rope_and_activation_are_named(checkpoints):
    raw = json.loads((Path(checkpoints.get("llama", "llama")) / "config.json").read_text())
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf_dict({**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2}})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_dict({**raw, "hidden_act": "gelu"})


def test_bad_layouts_are_named(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints.get("llama", "llama"))  # 4 heads, 2 KV heads, 4 layers
    with pytest.raises(ValueError, match="tp=3 cannot split 4 attention heads"):
        check_layout(cfg, Layout.contiguous(tp=3))
    with pytest.raises(ValueError, match="pp=5 exceeds the 4 layers"):
        check_layout(cfg, Layout.contiguous(pp=5))
    with pytest.raises(ValueError, match="needs pp\\*dp\\*tp"):
        Layout((0, 1, 2), tp=2)


def test_truncated_checkpoint_is_named(checkpoints, tmp_path):
    src = Path(checkpoints.get("llama", "llama"))
    bad = tmp_path / "truncated"
    shutil.copytree(src, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    cfg = ModelConfig.from_pretrained(bad)
    shard = shard_for(cfg, Layout((0,)), 0)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        reader = CheckpointReader(bad)
        reader.check({ts.source: ts.full_shape for ts in shard.tensors.values()})
        for ts in shard.tensors.values():
            reader.read(ts)


def test_missing_and_misshaped_tensors_are_named(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints.get("llama", "llama"))
    reader = CheckpointReader(checkpoints.get("llama", "llama"))
    shard = shard_for(cfg, Layout((0,)), 0)
    expected = {ts.source: ts.full_shape for ts in shard.tensors.values()}
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.9.mlp.up_proj.weight'"):
        reader.check({**expected, "model.layers.9.mlp.up_proj.weight": (128, 64)})
    with pytest.raises(ValueError, match="'model.norm.weight' .* has shape \\[64\\], expected \\[65\\]"):
        reader.check({**expected, "model.norm.weight": (65,)})
