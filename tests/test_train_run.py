"""End-to-end runs of ``shardflow train`` on gloo ranks: the example learns, resume reproduces,
PPO with a critic and a reward model runs, and config errors stop the run before any rank starts."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from shardflow.cli.main import main
from shardflow.config.load import load_config
from shardflow.examples.arithmetic import example_config
from shardflow.runtime.calls.budget import CPU_TOKENS


def train_job(world, raw: dict, overrides: list[str]):
    from shardflow.runtime.driver import train_rank
    from shardflow.runtime.validate import prepare

    train_rank(world, prepare(load_config(None, overrides, base=raw)))


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict:
    """The shipped example's config, its starting checkpoint made once for the module."""
    return example_config(tmp_path_factory.mktemp("example"))


def test_example_run_writes_its_plan_timeline_and_a_transformers_checkpoint(pool, example, tmp_path):
    # That the example's reward rises under GRPO (and every other online algorithm) is
    # tests/test_algorithms.py's; here, what a run leaves behind.
    out = tmp_path / "run"
    pool.run(train_job, example, ["run.iterations=2", f"run.out_dir={out}", "run.progress=false",
                                  "run.tensorboard=false"])
    assert [m["step"] for m in metrics(out)] == [1, 2]
    # the budget unset: the CPU ranks' fixed one, reported with the step's other training metrics
    assert all(m["actor/micro_batch_tokens"] == CPU_TOKENS for m in metrics(out))
    assert (out / "timeline.png").is_file() and (out / "plan.yaml").is_file()
    saved = out / "checkpoints" / "iter-000002" / "actor"
    transformers.AutoModelForCausalLM.from_pretrained(saved)


def test_resume_reproduces_the_uninterrupted_run(pool, example, tmp_path):
    common = ["run.progress=false", "run.tensorboard=false"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    pool.run(train_job, example, ["run.iterations=4", f"run.out_dir={straight}", *common])
    pool.run(train_job, example, ["run.iterations=2", f"run.out_dir={stopped}", *common])
    pool.run(train_job, example, ["run.iterations=4", f"run.out_dir={stopped}", *common])  # resumes at 2
    a, b = metrics(straight), metrics(stopped)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        same = {k: v for k, v in x.items() if not k.startswith("time") and k != "generation/tokens_per_s"}
        assert same == {k: y[k] for k in same}, x["step"]


def test_resume_under_another_plan_on_fewer_ranks(pool, example, tmp_path, monkeypatch):
    """3 iterations on 4 ranks, then 3 more on 2 ranks in other layouts: iterations 4-6 match an
    uninterrupted 4-rank run (the same seeds and data order) to float32 tolerance."""
    common = ["run.progress=false", "run.tensorboard=false"]
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    pool.run(train_job, example, ["run.iterations=6", f"run.out_dir={straight}", *common])
    pool.run(train_job, example, ["run.iterations=3", f"run.out_dir={moved}", *common])
    plan = tmp_path / "two.yaml"
    plan.write_text(yaml.safe_dump({"calls": {"actor_gen": "d2p1t1@0-1", "ref_inf": "d1p1t1@1",
                                              "actor_train": "d1p1t2@0-1"}}))
    pool.run(resume_job, example, ["run.iterations=6", f"run.out_dir={moved}", "run.devices=2", f"plan={plan}",
                                   *common])
    a, b = metrics(straight), metrics(moved)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a[3:], b[3:]):
        assert x["reward/mean"] == y["reward/mean"] and x["response_length/mean"] == y["response_length/mean"]
        for key in ("actor/policy_loss", "actor/kl", "actor/grad_norm", "actor/entropy"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    last = tmp_path / "straight" / "checkpoints" / "iter-000006" / "actor"
    moved_last = moved / "checkpoints" / "iter-000006" / "actor"
    wa = transformers.AutoModelForCausalLM.from_pretrained(last).state_dict()
    wb = transformers.AutoModelForCausalLM.from_pretrained(moved_last).state_dict()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5)


def resume_job(world, raw: dict, overrides: list[str]):
    """``train_job`` with unpickling refused while the run loads its checkpoint."""
    import pickle

    from shardflow.runtime import driver

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    saved = (pickle.load, pickle.loads, torch.load, driver.Run.__init__)

    def guarded_init(self, *args, **kwargs):
        pickle.load, pickle.loads, torch.load = refuse, refuse, refuse
        try:
            saved[3](self, *args, **kwargs)
        finally:
            pickle.load, pickle.loads, torch.load = saved[:3]

    driver.Run.__init__ = guarded_init
    try:
        train_job(world, raw, overrides)
    finally:
        driver.Run.__init__ = saved[3]


def test_ppo_with_critic_reward_model_and_kl_in_reward(pool, checkpoints, example, tmp_path):
    actor = example["models"]["actor"]["path"]
    critic = checkpoints.get("llama_value", "llama", value_head=True)
    raw = {**example, "models": {"actor": {"path": actor, "optim": {"lr": 1e-4}}, "ref": {"path": actor},
                                 "critic": {"path": critic, "optim": {"lr": 1e-4}}, "reward": {"path": critic}}}
    raw["reward"] = {"kind": "model"}
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"calls": {
        "actor_gen": "d2p1t2@0-3", "reward_inf": "d1p1t1@4", "ref_inf": "d1p2t1@5-6",
        "critic_inf": "d2p1t1@6-7", "actor_train": "d1p2t2@0-3", "critic_train": "d2p1t2@4-7"}}))
    out = tmp_path / "ppo"
    pool.run(train_job, raw, ["algorithm.name=ppo", "algorithm.kl.coef=0.05", "algorithm.kl.in_reward=true",
                              "algorithm.mini_batches=2", "run.iterations=2", "run.devices=8", f"plan={plan}",
                              f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false"])
    for m in metrics(out):
        for key in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm", "critic/grad_norm", "reward/mean",
                    "time/critic_inf", "time/reward_inf", "time/realloc/actor_gen"):
            assert key in m and math.isfinite(m[key]), (key, m)
    saved = out / "checkpoints" / "iter-000002"
    transformers.AutoModelForSequenceClassification.from_pretrained(saved / "critic")
    # The critic was trained: its weights moved.
    before = transformers.AutoModelForSequenceClassification.from_pretrained(critic).state_dict()
    after = transformers.AutoModelForSequenceClassification.from_pretrained(saved / "critic").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _partial_plan(tmp_path: Path) -> list[str]:
    plan = tmp_path / "partial.yaml"
    plan.write_text(yaml.safe_dump({"calls": {"actor_gen": "d4p1t1@0-3", "actor_train": "d1p2t2@0-3"}}))
    return [f"plan={plan}"]


def _malformed_prompts(tmp: Path) -> list[str]:
    data = tmp / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    return [f"data.path={data}"]


def _checkpoint_of_an_earlier_format(tmp: Path) -> list[str]:
    """A checkpoint written with the optimizer state pickled per rank (no format in its state)."""
    root = tmp / "out" / "checkpoints"
    (root / "iter-000001").mkdir(parents=True)
    (root / "iter-000001" / "state.json").write_text(json.dumps({"iteration": 1, "layouts": {"actor": "d4p1t1@0-3"}}))
    (root / "latest").write_text("iter-000001\n")
    return []


BAD_CONFIGS = {
    "unknown key": (lambda tmp: ["algorithm.batch_sise=4"], r"did you mean 'algorithm.batch_size'"),
    "malformed prompts file": (_malformed_prompts, r"prompts.jsonl line 2 is not valid JSON"),
    "reward function missing": (lambda tmp: ["reward.kind=function", "reward.function=no_such_module_xyz:f"],
                                r"cannot import module 'no_such_module_xyz'"),
    "resume of an earlier checkpoint format": (_checkpoint_of_an_earlier_format,
                                               r"run.resume: the checkpoint .*iter-000001 keeps its optimizer state in "
                                               r"per-rank pickles"),
    "wrong type": (lambda tmp: ["run.iterations=many"], r"'run.iterations' must be int, got 'many'"),
    "too few devices": (lambda tmp: ["run.devices=2"], r"uses device\(s\) \[2, 3\] but only 2 exist"),
    "plan misses a call": (_partial_plan, r"does not cover call\(s\) \['ref_inf'\]"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_errors_stop_before_any_rank_starts(example, tmp_path, capsys, case):
    overrides, message = BAD_CONFIGS[case]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(example))
    extra = overrides(tmp_path)
    existed = (tmp_path / "out").exists()
    start = time.monotonic()
    assert main(["train", str(config), *extra, f"run.out_dir={tmp_path / 'out'}"]) == 2
    assert time.monotonic() - start < 10  # the checks alone (modules are loaded): no rank was started
    err = capsys.readouterr().err
    assert err.startswith("shardflow: error:") and re.search(message, err) and err.count("\n") == 1, err
    assert (tmp_path / "out").exists() == existed  # nothing was started


def test_a_finished_run_says_so_instead_of_training_nothing(example, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(example))
    root = tmp_path / "out" / "checkpoints"
    (root / "iter-000003").mkdir(parents=True)
    (root / "iter-000003" / "state.json").write_text(json.dumps({"iteration": 3, "layouts": {}}))
    (root / "latest").write_text("iter-000003\n")
    assert main(["train", str(config), "run.iterations=3", f"run.out_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do: the run in" in out and "has reached its 3 iterations (iter-000003)" in out, out
    assert "run.resume=false to start afresh" in out


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    """The same rule for every command: examples/ppo_7b.yaml names its models relative to itself."""
    example_file = Path(__file__).resolve().parents[1] / "examples" / "ppo_7b.yaml"
    monkeypatch.chdir(tmp_path)
    config = load_config(example_file)
    assert Path(config.models["actor"].path) == example_file.parent / "models" / "llama2-7b"
    assert (Path(config.models["critic"].path) / "config.json").is_file()
    assert Path(config.data.path) == example_file.parent / "prompts.jsonl"
    assert not config.run.output_dir.is_absolute()  # outputs go where the command runs
