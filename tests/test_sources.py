"""Datasets by name and by directory: the rows of a split, the column mapping, and clear errors
for a split, a column or a dataset that does not exist, all before any rank starts."""

from __future__ import annotations

import json

import pytest

from shardflow.config.experiment import DataConfig
from shardflow.data.prompts import load_prompts
from shardflow.data.sources import Source, dataset_rows
from shardflow.models.tiny import char_tokenizer

datasets = pytest.importorskip("datasets")

TRAIN = [{"question": "1+1=", "solution": "2"}, {"question": "2+3=", "solution": "5"}]
TEST = [{"question": "4+4=", "solution": "8"}]
MAPPED = dict(prompt_key="question", answer_key="solution")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def saved_dict(path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(str(path))
    return path


def hub_layout(path):
    """Data files named by split, as a dataset repository on the Hub holds them."""
    (path / "data").mkdir(parents=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        (path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_saved_dataset_dict_by_split_with_mapped_columns(tmp_path, tok):
    path = saved_dict(tmp_path / "ds")
    train = load_prompts(DataConfig(path=str(path), **MAPPED), tok)
    assert [p.answer for p in train] == ["2", "5"] and train[0].text.startswith("user: 1+1=")
    test = load_prompts(DataConfig(path=str(path), split="test", **MAPPED), tok)
    assert [p.answer for p in test] == ["8"]


def test_a_single_saved_split_and_a_directory_of_data_files(tmp_path, tok):
    datasets.Dataset.from_list(TEST).save_to_disk(str(tmp_path / "one"))
    assert [p.answer for p in load_prompts(DataConfig(path=str(tmp_path / "one"), **MAPPED), tok)] == ["8"]
    files = hub_layout(tmp_path / "files")
    assert [p.answer for p in load_prompts(DataConfig(path=str(files), split="test", **MAPPED), tok)] == ["8"]


def test_a_dataset_by_name_from_the_local_cache(tmp_path, tok, monkeypatch):
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    repo = cache / "datasets--acme--sums"
    hub_layout(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    prompts = load_prompts(DataConfig(dataset="acme/sums", split="test", **MAPPED), tok)
    assert [p.answer for p in prompts] == ["8"]
    with pytest.raises(ValueError, match="data.dataset 'acme/other' is not in the local Hugging Face cache.*"
                                         "allow_download=true"):
        load_prompts(DataConfig(dataset="acme/other", **MAPPED), tok)


def test_a_split_or_a_column_that_does_not_exist(tmp_path, tok):
    path = saved_dict(tmp_path / "ds")
    with pytest.raises(ValueError, match=r"data.split 'validation' is not a split of .* \(splits: train, test\)"):
        load_prompts(DataConfig(path=str(path), split="validation", **MAPPED), tok)
    with pytest.raises(ValueError, match=r"has no column 'answer' \(columns: question, solution\)"):
        load_prompts(DataConfig(path=str(path), prompt_key="question"), tok)
    with pytest.raises(ValueError, match="none of the columns 'prompt', 'messages'"):
        load_prompts(DataConfig(path=str(path), answer_key="solution"), tok)
    # the answer is not needed when nothing reads it
    assert len(load_prompts(DataConfig(path=str(path), prompt_key="question"), tok, require_answer=False)) == 2


def test_rows_are_named_in_errors(tmp_path):
    path = saved_dict(tmp_path / "ds")
    where = [w for w, _ in dataset_rows(Source("eval", path=str(path), split="test"))]
    assert where == [f"{path} (split test) row 0"]
    with pytest.raises(ValueError, match="eval.path or eval.dataset must be set"):
        list(dataset_rows(Source("eval")))
