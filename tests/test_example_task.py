"""The shipped arithmetic example: files as the generator writes them, right answers, a valid config,
and a starting checkpoint that transformers loads."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardflow.config.experiment import DataConfig
from shardflow.config.load import load_config
from shardflow.data.prompts import load_prompts
from shardflow.examples import arithmetic, arithmetic_tools, smollm2
from shardflow.rl.rewards.math_answer import math_score


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    arithmetic.write_task(tmp_path)
    arithmetic_tools.write_task(tmp_path)
    smollm2.write_task(tmp_path)
    shipped = sorted(p.relative_to(arithmetic.DATA_DIR) for p in arithmetic.DATA_DIR.rglob("*") if p.is_file())
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert shipped == written
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (arithmetic.DATA_DIR / rel).read_bytes(), rel


def test_every_answer_is_right_and_verifiable():
    rows = [json.loads(line) for line in arithmetic.TASK_FILE.read_text().splitlines()]
    assert len(rows) == 36
    for row in rows:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups())
        assert row["answer"] == str(a + b)
        assert math_score(row["answer"], row["answer"]) == 1.0


def test_start_checkpoint_and_config(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardflow.models.tiny import make_tiny_checkpoint

    start = arithmetic.make_start_checkpoint(tmp_path / "start", steps=5)
    raw = arithmetic.example_config(tmp_path)  # reuses the checkpoint made above
    assert raw["models"]["actor"]["path"] == str(start)
    config = load_config(None, base=raw)
    assert config.algorithm.name == "grpo" and config.run.devices == 4

    tokenizer = AutoTokenizer.from_pretrained(start)
    prompts = load_prompts(config.data, tokenizer)
    assert len(prompts) == 36 and prompts[0].text == "user: 0+0=\nassistant: "

    def answer_nll(path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        answers = [tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [2] for p in prompts]
        examples = [(list(p.ids) + a, [0] * len(p.ids) + [1] * len(a)) for p, a in zip(prompts, answers)]
        ids, targets = arithmetic.padded(examples, tokenizer.pad_token_id)
        with torch.no_grad():
            logits = model(ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[:, 1:], ignore_index=-100).item()

    # five warm-up steps already lower the loss of the answers below that of the same random start
    random_start = make_tiny_checkpoint(tmp_path / "random", "llama", seed=0, **arithmetic.MODEL_SHAPE)
    assert answer_nll(start) < answer_nll(random_start) - 0.5


def test_warmup_tokenizer_matches_the_package_one():
    from transformers import AutoTokenizer

    from shardflow.models.tiny import char_tokenizer

    shipped = AutoTokenizer.from_pretrained(arithmetic.TOKENIZER_DIR)
    text = "user: 3+4=\nassistant: 7"
    assert shipped(text)["input_ids"] == char_tokenizer()(text)["input_ids"]
    prompts = load_prompts(DataConfig(path=str(arithmetic.TASK_FILE), max_prompt_tokens=64), shipped)
    assert max(len(p.ids) for p in prompts) <= 64


def test_no_warmup_is_the_random_start(tmp_path):
    from safetensors.torch import load_file

    from shardflow.models.tiny import make_tiny_checkpoint

    start = arithmetic.make_start_checkpoint(tmp_path / "start", steps=0)
    random_start = make_tiny_checkpoint(tmp_path / "random", "llama", seed=0, **arithmetic.MODEL_SHAPE)
    a, b = load_file(start / "model.safetensors"), load_file(random_start / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_real_model_task_is_right_and_its_held_out_set_apart():
    train = [json.loads(line) for line in smollm2.TRAIN_FILE.read_text().splitlines()]
    held_out = [json.loads(line) for line in smollm2.EVAL_FILE.read_text().splitlines()]
    assert len(train) == smollm2.TRAIN_ROWS and len(held_out) == smollm2.EVAL_ROWS
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        numbers = [int(n) for n in re.findall(r"\d+", row["prompt"])]
        text = row["prompt"]
        expected = (numbers[0] * numbers[1] if "times" in text else
                    numbers[0] - numbers[1] if (" - " in text or "away" in text) else numbers[0] + numbers[1])
        assert row["answer"] == str(expected), row


def test_the_real_model_example_names_its_missing_package(monkeypatch):
    import importlib.util

    import pytest

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == smollm2.MODEL_PACKAGE
                        else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install -e '.\[examples\]'"):
        smollm2.gguf_file()


def test_a_tool_start_that_cannot_write_the_call_is_made_again_then_refused(tmp_path):
    """The tool example's start is checked: a warm-up too short to learn the calculator call is run
    again from the next seeds, then refused with each seed's figure; nothing half-made is left."""
    with pytest.raises(RuntimeError, match=r"seed 0: \d+\.\d+, seed 1: \d+\.\d+, seed 2: \d+\.\d+"):
        arithmetic_tools.make_start_checkpoint(tmp_path / "start", steps=1)
    assert list(tmp_path.iterdir()) == []
