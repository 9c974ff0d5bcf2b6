"""Held-out evaluation: the metrics by hand, the greedy pass against transformers' greedy
generation, the same answers from ``shardflow eval`` under another layout, and bad settings
refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from gen_helpers import hf_greedy

from shardflow.cli.main import main
from shardflow.config.load import load_config
from shardflow.examples import arithmetic
from shardflow.rl.rewards.math_answer import math_score
from shardflow.runtime.evaluation import Scored, eval_metrics


def test_metrics_by_hand():
    greedy = [Scored(0, 1.0, 3, "", "stop"), Scored(1, 0.0, 5, "", "stop"), Scored(2, 0.5, 4, "", "length")]
    # 3 prompts x 2 samples: prompt 0 solved once, prompt 1 never, prompt 2 twice
    rewards = [1.0, 0.0, 0.0, 0.2, 1.0, 1.0]
    sampled = [Scored(i, r, 1, "", "stop") for i, r in enumerate(rewards)]
    m = eval_metrics(greedy, sampled, num_prompts=3, samples=2, correct_reward=1.0)
    assert m["eval/pass@1"] == pytest.approx(1 / 3)
    assert m["eval/greedy_reward"] == pytest.approx(0.5)
    assert m["eval/response_length"] == pytest.approx(4.0)
    assert m["eval/mean@2"] == pytest.approx(sum(rewards) / 6)
    assert m["eval/pass@2"] == pytest.approx(2 / 3)
    # a lower bar counts the 0.5 greedy answer and the 0.2 sample
    low = eval_metrics(greedy, sampled, num_prompts=3, samples=2, correct_reward=0.2)
    assert low["eval/pass@1"] == pytest.approx(2 / 3) and low["eval/pass@2"] == pytest.approx(1.0)


def train_job(world, raw: dict, overrides: list[str]):
    from shardflow.runtime.driver import train_rank
    from shardflow.runtime.validate import prepare

    train_rank(world, prepare(load_config(None, overrides, base=raw)))


def eval_job(world, raw: dict, overrides: list[str], checkpoint: str, out: str):
    from shardflow.runtime.driver import eval_rank
    from shardflow.runtime.validate import prepare_eval

    eval_rank(world, prepare_eval(load_config(None, overrides, base=raw), Path(checkpoint)), Path(out))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def evaluated_run(pool, tmp_path_factory):
    """Two GRPO iterations of the example evaluated before, after each and at the end."""
    raw = arithmetic.example_config(tmp_path_factory.mktemp("example"))
    out = tmp_path_factory.mktemp("run")
    pool.run(train_job, raw, ["run.iterations=2", f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false",
                              f"eval.path={arithmetic.TASK_FILE}", "eval.every=1", "eval.samples=3"])
    return raw, out


def test_training_evaluates_before_after_each_and_at_the_end(evaluated_run):
    raw, out = evaluated_run
    records = lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "reward/mean" not in records[0]  # before training: the evaluation alone
    for r in records:
        assert r["eval/prompts"] == 36 and "eval/mean@3" in r and "eval/pass@3" in r
        samples = lines(out / "eval" / f"iter-{r['step']}.jsonl")
        assert len(samples) == 36 and all(len(s["sampled_rewards"]) == 3 for s in samples)
        # the file's rewards are the math reward of its responses, and the metrics follow from them
        for s in samples:
            assert s["reward"] == math_score(s["response"], s["answer"])
        assert r["eval/pass@1"] == pytest.approx(sum(s["reward"] >= 1 for s in samples) / 36)
        assert r["eval/mean@3"] == pytest.approx(sum(sum(s["sampled_rewards"]) for s in samples) / 108)
        assert r["eval/pass@3"] == pytest.approx(sum(max(s["sampled_rewards"]) >= 1 for s in samples) / 36)


def test_the_greedy_pass_is_transformers_greedy_generation(evaluated_run):
    raw, out = evaluated_run
    from transformers import AutoTokenizer

    start = raw["models"]["actor"]["path"]
    tokenizer = AutoTokenizer.from_pretrained(start)
    max_new = load_config(None, base=raw).generation.max_new_tokens
    for s in lines(out / "eval" / "iter-0.jsonl"):  # before training: the starting checkpoint's answers
        prompt = tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
        expected = hf_greedy(start, prompt, max_new, eos=tokenizer.eos_token_id)
        assert s["response"] == tokenizer.decode(expected, skip_special_tokens=True), s


def test_shardflow_eval_of_a_checkpoint_under_another_layout(pool, evaluated_run, tmp_path):
    raw, out = evaluated_run
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"calls": {"actor_gen": "d2p1t2@0-3"}}))
    result = tmp_path / "eval.json"
    checkpoint = sorted((out / "checkpoints").glob("iter-*"))[-1]
    pool.run(eval_job, raw, [f"eval.path={arithmetic.TASK_FILE}", "eval.samples=0", f"plan={plan}",
                             f"run.out_dir={tmp_path}"], str(checkpoint), str(result))
    scores = json.loads(result.read_text())
    trained = lines(out / "metrics.jsonl")[-1]
    assert scores["checkpoint"] == str(checkpoint / "actor")
    assert scores["eval/pass@1"] == pytest.approx(trained["eval/pass@1"])
    assert "eval/mean@3" not in scores
    # the same greedy answers as the training run's last evaluation, under tp=2 instead of dp=4
    mine = [s["response"] for s in lines(result.with_suffix(".jsonl"))]
    assert mine == [s["response"] for s in lines(out / "eval" / "iter-2.jsonl")]


@pytest.mark.parametrize("overrides, message", [
    (["eval.path=nowhere.jsonl"], "eval.path nowhere.jsonl does not exist"),
    (["eval.max_new_tokens=999"], "eval.max_new_tokens (999) must not exceed generation.max_new_tokens"),
    (["eval.dataset=acme/sums"], "one of them, not both"),
    (["algorithm.name=sft", "data.response_key=answer", "algorithm.kl.coef=0"], "has no generate call"),
    (["eval.path={task}", "data.answer_key=solution"], "no 'solution' field"),
])
def test_bad_evaluation_settings_are_refused_before_the_ranks(tmp_path, capsys, overrides, message):
    overrides = [o.format(task=arithmetic.TASK_FILE) for o in overrides]
    if not any(o.startswith("eval.path") for o in overrides):
        overrides.insert(0, f"eval.path={arithmetic.TASK_FILE}")
    assert main(["train", f"run.out_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_a_logger_that_is_not_installed_is_named_before_the_ranks(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", f"run.out_dir={tmp_path}", "run.wandb.enabled=true"]) == 2
    assert "run.wandb.enabled needs the wandb package" in capsys.readouterr().err


def test_eval_without_held_out_prompts_is_refused(tmp_path, capsys):
    assert main(["eval", f"run.out_dir={tmp_path}"]) == 2
    assert "shardflow eval needs eval.path or eval.dataset" in capsys.readouterr().err


def test_scored_lengths_count_response_tokens_only():
    from shardflow.data.batch import SequenceBatch
    from shardflow.runtime.calls.data import Held
    from shardflow.runtime.evaluation import _local_responses

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    batch = SequenceBatch.from_lists([7, 3], {"input_ids": [torch.tensor([1, 2, 9, 9]), torch.tensor([5, 6, 7])]},
                                     {"prompt_lengths": torch.tensor([2, 1])}, {"finish_reason": ["stop", "length"]})
    got = _local_responses({"responses": Held(None, batch)}, Tok())
    assert got == {7: (2, "9,9", "stop"), 3: (2, "6,7", "length")}
