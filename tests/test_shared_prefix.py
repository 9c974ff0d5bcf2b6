"""Samples of one prompt reading its prompt KV from one slot in decode (``shared_prefix``): the
same tokens and log-probabilities as each reading its own copy, while group leaders finish and
their slots go to later admissions, with bucket padding, and across detach/adopt and evict; the
shared columns only ever name the slot of a row of the same batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gen_helpers import local_model, prompts
from shardflow.engine.cuda_graphs import DecodeRunner
from shardflow.engine.generate import Engine, EngineConfig, _prefills_together, _shared_columns
from shardflow.engine.requests import Request, SamplingParams, make_requests


@pytest.fixture(scope="module")
def model(checkpoints):
    return local_model(checkpoints.get("llama", "llama"))


def grpo_requests(num_prompts: int = 4) -> list[Request]:
    """3 samples per prompt, sampled with per-request seeds; sample 0 (the first leader) ends
    first, and the prompts' lengths differ, so leaders leave while their followers go on."""
    requests = make_requests(prompts()[:num_prompts], SamplingParams(temperature=1.0, seed=3), samples_per_prompt=3)
    for r in requests:
        j = r.request_id % 3
        r.params = dataclasses.replace(r.params, max_new_tokens=(2, 4, 6)[j] + r.group % 2)
    return requests


def engine_for(model, shared: bool, pad: bool, cache=None) -> Engine:
    # 5 slots for units of 3: a unit waits for a leaving request's slot
    engine = Engine(model, EngineConfig(max_seq_len=64, max_batch_size=5, shared_prefix=shared), eos_token_ids=(2,),
                    cache=cache)
    if pad:  # the bucket padding of CUDA graphs, on an eager step
        engine.decode = DecodeRunner(engine._step_fn, max_batch=engine.cache.num_slots,
                                     scratch_slot=engine.cache.scratch_slot, device=engine.device, graphs=False,
                                     pad=True)
    return engine


def check_columns(engine: Engine, log: list) -> None:
    """Wrap the engine's decode step: before each step, check its shared columns against the rows."""
    runner, step = engine.decode, engine.decode.step

    def checked(ints, floats, mode):
        n = runner.batch
        slots, positions, shared_slots, shared_lens = (ints[i].tolist() for i in (2, 1, 5, 6))
        by_slot = {r.slot: r for r in engine.active}  # every row of the batch still holds its slot
        rows = [by_slot[s] for s in slots[:n]]
        assert shared_lens[n:] == [0] * (len(slots) - n)  # padding shares nothing
        for b, r in enumerate(rows):
            first = next(i for i, x in enumerate(rows) if r.prefix_len and x.prefix_source == r.prefix_source
                         or x is r)
            assert all(x.prefix_source == r.prefix_source for x in rows[first:b + 1])  # adjacent
            if b == first:
                assert shared_lens[b] == 0
                continue
            # the leader: the group's first row in this batch, holding its slot, same prefill
            assert shared_slots[b] == slots[first] and shared_slots[b] not in engine.cache._free
            assert shared_lens[b] == r.prefix_len == len(r.prompt_ids) <= positions[b]
        log.append([(r.slot, r.prefix_source, shared_slots[b], shared_lens[b]) for b, r in enumerate(rows)])
        return step(ints, floats, mode)

    runner.step = checked


def assert_same(a: list[Request], b: list[Request]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids and x.finish_reason == y.finish_reason
        assert x.output_logprobs == y.output_logprobs  # the same numbers read: bitwise equal


@pytest.mark.parametrize("pad", [False, True])
def test_shared_prefix_gives_the_tokens_of_own_copies_as_leaders_leave(model, pad):
    outputs, logs = {}, {}
    for shared in (False, True):
        engine = engine_for(model, shared, pad)
        check_columns(engine, logs.setdefault(shared, []))
        outputs[shared] = engine.generate(grpo_requests())
    assert_same(outputs[True], outputs[False])

    # The run did what the test is about: a group's leader left, and while the group still
    # decoded, its old slot went to a request of another prefill.
    led, reused = set(), False  # (slot, prefill) pairs that led before the current step
    for step in logs[True]:
        live = {source for _, source, _, _ in step}
        reused |= any(s == slot and a != source and a in live for slot, source, *_ in step for s, a in led)
        led |= {(leader, source) for _, source, leader, n in step if n}
    assert reused


def test_samples_move_together_through_detach_adopt_and_evict(model):
    outputs = {}
    for shared in (False, True):
        first = engine_for(model, shared, pad=True)
        requests = grpo_requests(3)
        first.submit(requests)
        for _ in range(3):
            first.step()
        active, waiting = first.detach()
        assert len({r.prefix_source for r in active}) > 1
        # another engine over the same memory adopts them out of order: each prefill's samples
        # are put back next to each other
        second = engine_for(model, shared, pad=True, cache=first.cache)
        second.adopt(active[::-1])
        sources = [r.prefix_source for r in second.active]
        assert sources == sorted(sources, key=sources.index)
        log = []
        check_columns(second, log)
        second.submit(waiting)
        for _ in range(2):
            second.step()
        assert any(n for step in log for *_, n in step)
        moved = second.evict()  # recomputed alone elsewhere: nothing shared any more
        assert all(r.prefix_len == 0 and r.prefix_source is None for r in moved)
        third = engine_for(model, shared, pad=False)
        check_columns(third, [])
        third.generate(moved)
        outputs[shared] = requests
    assert_same(outputs[True], outputs[False])


def test_shared_columns_and_grouping():
    def req(i, source, n, slot):
        r = Request(request_id=i, group=0, prompt_ids=[1] * 4, params=SamplingParams(), seed=0)
        r.prefix_source, r.prefix_len, r.slot = source, n, slot
        return r

    rows = [req(0, None, 0, 4), req(1, 1, 4, 2), req(2, 1, 4, 0), req(3, 3, 6, 1), req(4, 3, 6, 3)]
    assert _shared_columns(rows).tolist() == [[4, 2, 2, 1, 1], [0, 0, 4, 0, 6]]
    assert _shared_columns(rows[2:]).tolist() == [[0, 1, 1], [0, 0, 6]]  # row 1 left: row 2 leads
    assert _shared_columns([]).shape == (2, 0)
    with pytest.raises(AssertionError, match="not adjacent"):
        _shared_columns([rows[1], rows[3], rows[2]])
    assert _prefills_together([rows[1], rows[3], rows[0], rows[2], rows[4]]) == [rows[1], rows[2], rows[3], rows[4],
                                                                                 rows[0]]
    assert torch.equal(_shared_columns(_prefills_together(rows)), _shared_columns(rows))
