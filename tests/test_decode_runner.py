"""The decode runner's buffers: padding to buckets, the in-place advance, compaction (CPU, with
the bucket padding that CUDA graphs need but an eager step)."""

from __future__ import annotations

import torch

from shardflow.engine.generate.cuda_graphs import DecodeRunner, batch_buckets

SCRATCH = 9


def fake_step(calls):
    """Token = 10 * token + position + 1 (a pure function of the row's inputs); log-prob = slot."""
    def step(ints, floats, mode):
        calls.append((ints.clone(), floats.clone(), mode))
        return 10 * ints[0] + ints[1] + 1, ints[2].float()
    return step


def host_rows(tokens, positions, slots):
    n = len(tokens)  # top_k 0, seed 7; each row its own prompt group (ids 20, 21, ...) of a 3-token prompt
    ints = torch.tensor([tokens, positions, slots, [0] * n, [7] * n, list(range(20, 20 + n)), [3] * n])
    floats = torch.tensor([[1.0] * len(tokens), [0.5] * len(tokens)])
    return ints, floats


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(2) == [2]
    assert batch_buckets(5) == [2, 4, 5] and batch_buckets(8) == [2, 4, 8]  # one row runs as two


def test_rows_advance_in_place_padding_stays_on_the_scratch_slot_and_compaction_keeps_order():
    calls = []
    runner = DecodeRunner(fake_step(calls), max_batch=8, scratch_slot=SCRATCH, device=torch.device("cpu"),
                          graphs=False, pad=True)
    runner.load(*host_rows([1, 2, 3, 4, 5], [4, 5, 6, 7, 8], [0, 1, 2, 3, 4]))
    tokens, logprobs = runner.run("sample")
    assert tokens.tolist() == [15, 26, 37, 48, 59] and logprobs.tolist() == [0, 1, 2, 3, 4]
    ints, floats, mode = calls[-1]
    assert ints.shape == (7, 8) and mode == "sample"  # padded to the bucket of 8
    assert ints[2, 5:].tolist() == [SCRATCH] * 3 and ints[1, 5:].tolist() == [0] * 3  # the dummy rows
    assert ints[5, 5:].tolist() == [-1] * 3 and ints[6, 5:].tolist() == [0] * 3  # sharing no prompt
    assert floats[0, 5:].tolist() == [0.0] * 3  # greedy

    tokens, _ = runner.run("sample")  # the step's own next inputs: its tokens at the next positions
    assert tokens.tolist() == [10 * t + p + 1 for t, p in zip([15, 26, 37, 48, 59], [5, 6, 7, 8, 9])]
    ints, _, _ = calls[-1]
    assert ints[1, :5].tolist() == [5, 6, 7, 8, 9] and ints[1, 5:].tolist() == [0] * 3

    previous = tokens.tolist()
    runner.keep([0, 2, 4])  # rows 1 and 3 leave: bucket of 4, one padding row
    tokens, logprobs = runner.run("greedy")
    ints, floats, mode = calls[-1]
    assert ints.shape == (7, 4) and mode == "greedy" and runner.batch == 3
    assert ints[5].tolist() == [20, 22, 24, -1]  # prompt groups move with their rows
    assert ints[0, :3].tolist() == [previous[0], previous[2], previous[4]]
    assert ints[1, :3].tolist() == [6, 8, 10] and ints[2].tolist() == [0, 2, 4, SCRATCH]
    assert ints[1, 3] == 0 and floats[:, :3].tolist() == [[1.0] * 3, [0.5] * 3]
    assert logprobs.tolist() == [0, 2, 4]


def test_without_padding_a_step_computes_only_its_rows():
    calls = []
    runner = DecodeRunner(fake_step(calls), max_batch=8, scratch_slot=SCRATCH, device=torch.device("cpu"),
                          graphs=False)
    runner.load(*host_rows([1, 2, 3], [0, 0, 0], [0, 1, 2]))
    runner.run("greedy")
    runner.keep([2])
    tokens, _ = runner.run("greedy")
    assert calls[-1][0].shape == (7, 1) and tokens.tolist() == [10 * 31 + 1 + 1]
