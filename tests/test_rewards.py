"""Rule-based math reward, custom reward functions and their errors, reward-model scores."""

from __future__ import annotations

import textwrap

import pytest
import torch

from shardflow.config.experiment import RewardConfig
from shardflow.data.batch import SequenceBatch
from shardflow.models.tiny import EOS_ID, char_tokenizer
from shardflow.rl.rewards import reward_function
from shardflow.rl.rewards.math_answer import extract_answer, last_boxed, math_score
from shardflow.rl.rewards.scoring import last_token_scores, score_batch
from shardflow.rl.rewards.user import load_reward_function


def test_extract_answer():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{3}{4}} end") == r"\frac{3}{4}"
    assert last_boxed(r"cut off \boxed{\frac{3}{4}") is None
    assert extract_answer(r"so \boxed{12}.") == "12"
    assert extract_answer(r"so \boxed{12") is None  # a cut box is no answer, not the whole text
    assert extract_answer("Answer: 12 (or 13)", r"Answer:\s*(\d+)") == "12"
    assert extract_answer("x 3 y 4", r"\d") == "4"  # no group: the whole last match
    assert extract_answer("nothing here", r"Answer:\s*(\d+)") is None
    assert extract_answer("just 7") == "just 7"


@pytest.mark.parametrize("response, answer, pattern, expected", [
    ("12", "12", "", 1.0),
    (r"The sum is \boxed{12}.", "12", "", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", "", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", "", 1.0),
    (r"so \boxed{\dfrac{3}{4}}", "0.75", "", 1.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", "", 1.0),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", "", 0.0),
    ("first 3, finally 12", 12, "", 1.0),  # the last number of the response, numeric answers as text
    ("13", "12", "", 0.0),
    (r"\boxed{13} but 12", "12", "", 0.0),  # the box decides
    (r"\boxed{12", "12", "", 0.0),  # cut off
    ("no number at all", "12", "", 0.0),
    ("", "12", "", 0.0),
    ("Answer: 12. Check: 13", "12", r"Answer:\s*(\d+)", 1.0),
    ("It is 12", "12", r"Answer:\s*(\d+)", 0.0),  # the pattern is required
])
def test_math_score(response, answer, pattern, expected):
    assert math_score(response, answer, pattern=pattern) == expected


@pytest.mark.parametrize("response, answer", [
    ("12", "12"), ("12", "13"), (" 12 ", "12"), ("2", "2\n"), ("-3", "3"), ("3", "-3"), ("-12", "-12"), ("0", "-0"),
    ("00", "0"), ("0012", "12"), (r"\boxed{42}", "42"), (r"so \boxed{-7}", "-7"), ("+5", "5"), ("1", "1.0"),
    ("123456789012345678901", "123456789012345678901"), ("123456789012345678901", "123456789012345678902"),
    ("9999999999999999", "10000000000000000"),
])
def test_integer_answers_get_math_verifys_verdict(response, answer):
    from math_verify import parse, verify

    extracted = extract_answer(response)
    expected = float(verify(parse(answer), parse(extracted if extracted == response else f"${extracted}$")))
    assert math_score(response, answer) == expected


def test_math_reward_rejects_an_unreadable_reference():
    with pytest.raises(ValueError, match="reference answer 'banana' cannot be read"):
        math_score("12", "banana")
    fn = reward_function(RewardConfig(kind="math"))
    assert fn(["p", "p"], ["4", "5"], ["4", "4"]) == [1.0, 0.0]


def write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_custom_reward_function_loads_and_checks_results(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "my_rewards", """
        def length(prompts, responses, answers):
            return [float(len(r)) for r in responses]
        def short(prompts, responses, answers):
            return [1.0]
        def nan(prompts, responses, answers):
            return [float("nan")] * len(responses)
        def words(prompts, responses, answers):
            return ["many"] * len(responses)
    """)
    fn = reward_function(RewardConfig(kind="function", function="my_rewards:length"))
    assert fn(["a", "b"], ["xy", "xyz"], [None, None]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="'my_rewards:short' returned 1 rewards for 2 responses"):
        load_reward_function("my_rewards:short")(["a", "b"], ["x", "y"], [0, 0])
    with pytest.raises(ValueError, match="non-finite reward for response 0: nan"):
        load_reward_function("my_rewards:nan")(["a"], ["x"], [0])
    with pytest.raises(ValueError, match="must return a list of numbers"):
        load_reward_function("my_rewards:words")(["a"], ["x"], [0])
    # a file path works too
    fn = load_reward_function(f"{tmp_path / 'my_rewards.py'}:length")
    assert fn(["a"], ["abcd"], [None]) == [4.0]


def test_custom_reward_function_errors_name_the_problem(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "bad_rewards", """
        import math
        NOT_A_FUNCTION = 3
        def two_args(responses, answers):
            return []
        def keyword_only(*, prompts, responses, answers):
            return []
    """)
    write_module(tmp_path, monkeypatch, "broken_rewards", "import no_such_dependency_here\n")
    with pytest.raises(ValueError, match="must look like 'module:function'"):
        load_reward_function("bad_rewards")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz': ModuleNotFoundError"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="cannot import module 'broken_rewards'.*no_such_dependency_here"):
        load_reward_function("broken_rewards:f")
    with pytest.raises(ValueError, match="module 'bad_rewards' has no attribute 'missing'"):
        load_reward_function("bad_rewards:missing")
    with pytest.raises(ValueError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_reward_function("bad_rewards:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match=r"must accept \(prompts, responses, answers\); its signature is "
                                         r"two_args\(responses, answers\)"):
        load_reward_function("bad_rewards:two_args")
    with pytest.raises(ValueError, match="must accept"):
        load_reward_function("bad_rewards:keyword_only")
    with pytest.raises(ValueError, match="file 'nowhere.py' does not exist"):
        load_reward_function("nowhere.py:f")
    with pytest.raises(ValueError, match="computed by a reward model"):
        reward_function(RewardConfig(kind="model"))


def test_score_batch_decodes_prompts_and_responses():
    tok = char_tokenizer()
    seen = {}

    def fn(prompts, responses, answers):
        seen.update(prompts=prompts, responses=responses, answers=answers)
        return [1.0] * len(prompts)

    seqs, masks, plens = [], [], []
    for prompt, response in [("1+2=", "3"), ("4+4=", "7x")]:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [EOS_ID]
        seqs.append(torch.tensor(p + r))
        masks.append(torch.tensor([0.0] * len(p) + [1.0] * len(r)))
        plens.append(len(p))
    batch = SequenceBatch.from_lists([0, 1], {"input_ids": seqs, "loss_mask": masks},
                                     {"prompt_lengths": torch.tensor(plens)}, {"answers": ["3", "8"]})
    rewards = score_batch(batch, tok, fn).rewards
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 1.0]
    assert seen == {"prompts": ["1+2=", "4+4="], "responses": ["3", "7x"], "answers": ["3", "8"]}
    assert score_batch(batch, tok, reward_function(RewardConfig())).rewards.tolist() == [1.0, 0.0]

    def fragile(prompts, responses, answers):  # raises on one response of the batch
        if "7x" in responses:
            raise ZeroDivisionError("cannot score 7x")
        return [2.0] * len(responses)

    scores = score_batch(batch, tok, fragile, error_value=-1.0)  # contained: the others keep their reward
    assert scores.rewards.tolist() == [2.0, -1.0] and scores.errors == 1
    assert scores.first_error == "ZeroDivisionError: cannot score 7x"
    with pytest.raises(ZeroDivisionError):
        score_batch(batch, tok, fragile)  # not contained: the caller decides


def test_last_token_scores_match_transformers_sequence_classification(checkpoints):
    from transformers import AutoModelForSequenceClassification

    path = checkpoints.get("llama-value", "llama", value_head=True)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (n,), generator=gen) for n in (5, 9, 1)]
    with torch.no_grad():
        # per-position scores: the value head on each position's hidden state
        scores = [model.score(model.model(s[None]).last_hidden_state)[0, :, 0] for s in seqs]
        expected = torch.stack([model(s[None]).logits[0, 0] for s in seqs])
    batch = SequenceBatch.from_lists([0, 1, 2], {"input_ids": seqs})
    got = last_token_scores(batch, torch.cat(scores))
    assert torch.allclose(got, expected, atol=1e-6)
    with pytest.raises(ValueError, match="14 scores for a batch of 15 tokens"):
        last_token_scores(batch, torch.zeros(14))
