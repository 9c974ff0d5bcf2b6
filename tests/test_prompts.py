"""Prompt datasets: JSONL and Parquet, chat templates, errors that name the row; the sampler."""

from __future__ import annotations

import json

import pytest
import torch

from shardflow.config.experiment import DataConfig
from shardflow.data.prompts import PromptSampler, load_prompts, prompt_batch
from shardflow.models.tiny import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_with_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "answer": "3"},
        "",  # blank lines are skipped
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3="}], "answer": 6},
    ])
    prompts = load_prompts(DataConfig(path=path), tok)
    assert [p.index for p in prompts] == [0, 1]
    # the tiny tokenizer's template: "role: content\n" per message, then "assistant: "
    assert prompts[0].text == "user: 1+2=\nassistant: "
    assert prompts[1].text == "system: be brief\nuser: 2*3=\nassistant: "
    assert tok.decode(list(prompts[0].ids)) == prompts[0].text
    assert [p.answer for p in prompts] == ["3", 6]
    path = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "1+2="}])
    plain = load_prompts(DataConfig(path=path, chat_template=False), tok, require_answer=False)
    assert plain[0].text == "1+2=" and tok.decode(list(plain[0].ids)) == "1+2="


def test_parquet_prompts_equal_jsonl(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"{i}+1=", "solution": str(i + 1)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    config = dict(prompt_key="question", answer_key="solution")
    from_parquet = load_prompts(DataConfig(path=str(tmp_path / "d.parquet"), **config), tok)
    from_jsonl = load_prompts(DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), **config), tok)
    assert from_parquet == from_jsonl and len(from_parquet) == 5


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "1+1=", "answer": "2"}, '{"prompt": "2+2=", "answer": '], "line 2 is not valid JSON"),
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "   ", "answer": "0"}], "line 2: empty prompt"),
    # "user: " + 40 characters + "\n" + "assistant: ": 6 + 40 + 1 + 11 tokens of the character tokenizer
    ([{"prompt": "x" * 40, "answer": "0"}], "line 1: the prompt has 58 tokens, more than data.max_prompt_tokens = 32"),
    ([{"question": "1+1=", "answer": "2"}], "line 1: no 'prompt' or 'messages' field \\(fields: \\['answer', 'question'\\]\\)"),
    ([{"prompt": "1+1="}], "line 1: no 'answer' field"),
    ([[1, 2]], "line 1: a row must be an object with a prompt, got list"),
    ([{"prompt": 5, "answer": "5"}], "line 1: 'prompt' must be text, got int"),
    ([{"messages": [], "answer": "2"}], "line 1: 'messages' must be a non-empty list"),
    ([{"messages": [{"role": "user"}], "answer": "2"}], "line 1: message 0 must have text 'role' and 'content'"),
    ([{"messages": [{"role": "user", "content": ""}], "answer": "2"}], "line 1: empty prompt"),
])
def test_bad_rows_are_named(tmp_path, tok, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_prompts(DataConfig(path=path, max_prompt_tokens=32), tok)


def test_bad_files_and_settings(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(DataConfig(path=str(tmp_path / "none.jsonl")), tok)
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="must be a .jsonl or .parquet file or a dataset directory, got d.csv"):
        load_prompts(DataConfig(path=str(tmp_path / "d.csv")), tok)
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(ValueError, match="has no rows"):
        load_prompts(DataConfig(path=empty), tok)
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(ValueError, match="line 1: chat messages need data.chat_template=true"):
        load_prompts(DataConfig(path=path, chat_template=False), tok)
    no_template = char_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        load_prompts(DataConfig(path=path), no_template)


def test_parquet_rows_are_named(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}]),
                   tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="d.parquet row 1: empty prompt"):
        load_prompts(DataConfig(path=str(tmp_path / "d.parquet")), tok)


def test_prompt_batch(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+2=", "answer": "12"}])
    prompts = load_prompts(DataConfig(path=path, chat_template=False), tok)
    batch = prompt_batch([prompts[1], prompts[0]])
    assert batch.lengths.tolist() == [5, 4] and batch.seq_fields["prompt_index"].tolist() == [1, 0]
    assert batch.meta["answers"] == ["12", "3"]
    assert tok.decode(batch.token_fields["input_ids"][:5].tolist()) == "10+2="


def take(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_are_seeded_permutations():
    a = take(PromptSampler(10, 3, seed=1), 6)
    assert a == take(PromptSampler(10, 3, seed=1), 6)
    assert a != take(PromptSampler(10, 3, seed=2), 6)
    # 3 full batches per epoch; the 10th prompt of each epoch's order is left out
    for epoch in (a[:3], a[3:]):
        flat = [i for batch in epoch for i in batch]
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert a[:3] != a[3:]  # a new order each epoch
    assert take(PromptSampler(7, 2, seed=0, shuffle=False), 4) == [[0, 1], [2, 3], [4, 5], [0, 1]]
    with pytest.raises(ValueError, match="has 3 prompts, fewer than one batch of 4"):
        PromptSampler(3, 4, seed=0)


def test_sampler_resumes_where_it_stopped():
    run = PromptSampler(10, 3, seed=5)
    expected = take(run, 8)
    first = PromptSampler(10, 3, seed=5)
    take(first, 4)  # into the second epoch
    state = json.loads(json.dumps(first.state_dict()))  # it survives a round trip through a file
    resumed = PromptSampler(10, 3, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 4) == expected[4:]
    other = PromptSampler(11, 3, seed=5)
    with pytest.raises(ValueError, match="num_prompts was 10 when saved, now 11"):
        other.load_state_dict(state)


def test_sampler_order_does_not_depend_on_torch_seed():
    torch.manual_seed(0)
    a = take(PromptSampler(10, 5, seed=3), 2)
    torch.manual_seed(1)
    assert take(PromptSampler(10, 5, seed=3), 2) == a
