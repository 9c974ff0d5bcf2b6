"""``shardflow generate``: a round trip under dp=2, and clear errors for bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest
import torch
from gen_helpers import hf_greedy
from transformers import AutoTokenizer

from shardflow.cli.generate import _rank_main, prepare
from shardflow.cli.main import build_parser, main
from shardflow.parallel.world import World

MESSAGES = [{"role": "user", "content": "Say hi"}]


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_round_trip_under_two_replicas(checkpoints, tmp_path):
    model = checkpoints.get("llama", "llama")
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "The quick brown fox", "id": "a"}),
                                              json.dumps({"messages": MESSAGES}),
                                              "",  # blank lines are skipped
                                              json.dumps({"prompt": "jumps over"})])
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", model, "--input", inp, "--output", str(out), "--dp", "2",
               "--max-new-tokens", "6", "--temperature", "0", "--samples-per-prompt", "2", "--max-seq-len", "64"])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert [line["prompt"] for line in lines] == ["The quick brown fox"] * 2 + [chat] * 2 + ["jumps over"] * 2
    assert [line["sample"] for line in lines] == [0, 1] * 3 and lines[0]["id"] == "a"
    assert lines[2]["messages"] == MESSAGES
    for line in lines:
        prompt_ids = tokenizer(line["prompt"], add_special_tokens="messages" not in line)["input_ids"]
        assert line["completion_ids"] == hf_greedy(model, prompt_ids, 6)
        assert line["completion"] == tokenizer.decode(line["completion_ids"], skip_special_tokens=True)
        assert len(line["logprobs"]) == len(line["completion_ids"])
        assert line["finish_reason"] == ("stop" if line["completion_ids"][-1] == 2 else "length")


@pytest.mark.parametrize("lines,extra,message", [
    (['{"prompt": "ok"}', '{"prompt": "' + "x" * 40 + '"}'], ["--max-seq-len", "32"],
     r"in.jsonl:2: the prompt has 40 tokens; the context holds 32"),
    (['{"prompt": "ok"}', '{"prompt": ""}'], [], r"in.jsonl:2: empty prompt"),
    (['{"prompt": "ok"}', '{"prompt": "fine"}', '{"prompt": "broken'], [], r"in.jsonl:3: not valid JSON"),
    (['{"text": "ok"}'], [], r'in.jsonl:1: expected an object with either "prompt" or "messages"'),
    (['{"messages": []}'], [], r'in.jsonl:1: "messages" must be a non-empty list'),
    (['{"prompt": "ok"}'], ["--tp", "3"], r"tp=3 cannot split 4 attention heads"),
    (['{"prompt": "ok"}'], ["--top-p", "0"], r"top_p must be in \(0, 1\]"),
    pytest.param(['{"prompt": "ok"}'], ["--blas-library", "cublaslt"], r"--blas-library cublaslt needs a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")),
    pytest.param(['{"prompt": "ok"}'], ["--transposed-weights"], r"--transposed-weights needs a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")),
])
def test_bad_input_fails_before_any_rank_starts_and_keeps_the_output(checkpoints, tmp_path, capsys, lines,
                                                                      extra, message):
    model = checkpoints.get("llama", "llama")
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier output\n")
    rc = main(["generate", "--model", model, "--input", inp, "--output", str(out), *extra])
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
    assert out.read_text() == "earlier output\n"


def test_chunks_already_written_survive_a_later_failure(checkpoints, tmp_path):
    """Each chunk is written and flushed when it completes; a failure in a later chunk keeps them."""
    model = checkpoints.get("llama", "llama")
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": p}) for p in ("one", "two", "three", "four")])
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["generate", "--model", model, "--input", inp, "--output", str(out),
                                      "--max-new-tokens", "3", "--chunk-prompts", "1"])
    job = prepare(args)
    broken = dataclasses.replace(job.requests[2], prompt_ids=[])  # fails inside the engine, in chunk 3
    job = dataclasses.replace(job, requests=[*job.requests[:2], broken, *job.requests[3:]])
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="request 2 has an empty prompt"):
        _rank_main(world, job)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt"] for line in written] == ["one", "two"]
    assert all(len(line["completion_ids"]) == len(line["logprobs"]) >= 1 for line in written)


def test_the_parser_registers_generate():
    args = build_parser().parse_args(["generate", "--model", "m", "--input", "i", "--output", "o", "--dp", "2",
                                      "--tp", "4", "--top-k", "5", "--seed", "3"])
    assert isinstance(args, argparse.Namespace) and (args.dp, args.tp, args.top_k, args.seed) == (2, 4, 5, 3)
