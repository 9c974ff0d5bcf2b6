"""The simulator against schedules worked out by hand."""

from __future__ import annotations

import pytest

from shardflow.plan.simulator import SimCall, simulate


def test_sequential_on_shared_devices():
    # gen [0,1] 10 s -> inf [2,3] 4 s -> train [0,1] 5 s; the next gen waits for the train.
    calls = [
        SimCall(name="gen", devices=(0, 1), seconds=10, model="actor"),
        SimCall(name="inf", devices=(2, 3), seconds=4, deps=("gen",), model="ref"),
        SimCall(name="train", devices=(0, 1), seconds=5, deps=("gen", "inf"), model="actor", trains=True),
    ]
    r = simulate(calls, 4, iterations=3)
    assert r.iteration_ends == (19, 38, 57)
    assert r.iteration_s == 19


def test_next_iteration_overlaps_a_train_call_on_other_devices():
    # Iteration 0: gen 0-10, critic_inf 10-13, actor_train 13-17 (waits for critic_inf's output),
    # critic_train 13-21. Iteration 1: gen waits only for actor_train (17-27) and overlaps
    # critic_train; critic_inf 27-30 (input), actor_train 30-34, critic_train 30-38.
    # Iteration 2: gen 34-44, critic_inf 44-47, trains 47-51 and 47-55. Steady: (55 - 21) / 2.
    calls = [
        SimCall(name="actor_gen", devices=(0, 1), seconds=10, model="actor"),
        SimCall(name="critic_inf", devices=(2, 3), seconds=3, deps=("actor_gen",), model="critic"),
        SimCall(name="actor_train", devices=(0, 1), seconds=4, deps=("actor_gen", "critic_inf"), model="actor",
                trains=True),
        SimCall(name="critic_train", devices=(2, 3), seconds=8, deps=("actor_gen", "critic_inf"), model="critic",
                trains=True),
    ]
    r = simulate(calls, 4, iterations=3, events=True)
    assert r.iteration_ends == (21, 38, 55)
    assert r.iteration_s == 17
    gen1 = next(e for e in r.events if e.iteration == 1 and e.call == "actor_gen")
    assert (gen1.start, gen1.end) == (17, 27)


def test_reallocation_and_data_phases():
    # train's home is [0,1]; gen runs on [0..3] after a 2 s reallocation on [0..3]; inf on [2,3]
    # receives 1 s of data first. Iteration 0: realloc 0-2, gen 2-12, inf data 12-13 + 3 s -> 16,
    # train 16-21. Iteration 1: realloc waits for the train (21-23), gen 23-33, inf 33-37, train 37-42.
    calls = [
        SimCall(name="gen", devices=(0, 1, 2, 3), seconds=10, model="actor", realloc_seconds=2,
                realloc_devices=(0, 1)),
        SimCall(name="inf", devices=(2, 3), seconds=3, deps=("gen",), model="ref", data_seconds=1),
        SimCall(name="train", devices=(0, 1), seconds=5, deps=("gen", "inf"), model="actor", trains=True),
    ]
    r = simulate(calls, 4, iterations=2, events=True)
    assert r.iteration_ends == (21, 42)
    phases = [(e.call, e.phase, e.start, e.end) for e in r.events if e.iteration == 0]
    assert phases == [("gen", "realloc", 0, 2), ("gen", "compute", 2, 12), ("inf", "data", 12, 13),
                      ("inf", "compute", 13, 16), ("train", "compute", 16, 21)]


def test_a_reallocation_waits_for_busy_source_devices():
    # ref_inf keeps devices 0-1 busy until 6; the gen's reallocation needs them as its source.
    calls = [
        SimCall(name="ref_inf", devices=(0, 1), seconds=6, model="ref"),
        SimCall(name="gen", devices=(2, 3), seconds=4, model="actor", realloc_seconds=1, realloc_devices=(0, 1)),
        SimCall(name="train", devices=(0, 1), seconds=2, deps=("gen",), model="actor", trains=True),
    ]
    r = simulate(calls, 4, iterations=1, events=True)
    realloc = next(e for e in r.events if e.phase == "realloc")
    assert (realloc.start, realloc.end, realloc.devices) == (6, 7, (0, 1, 2, 3))
    assert r.iteration_ends == (13,)


def test_device_order_does_not_matter():
    # interleaved layouts list their ranks out of order; the devices are the same
    calls = [SimCall(name="a", devices=(0, 2, 1, 3), seconds=2, model="m"),
             SimCall(name="b", devices=(3, 5), seconds=1, model="n", realloc_seconds=1, realloc_devices=(1, 0))]
    r = simulate(calls, 6, iterations=1, events=True)
    assert [(e.call, e.phase, e.devices, e.start, e.end) for e in r.events] == [
        ("a", "compute", (0, 2, 1, 3), 0, 2), ("b", "realloc", (0, 1, 3, 5), 2, 3), ("b", "compute", (3, 5), 3, 4)]


def test_calls_without_devices_pass_their_inputs_through():
    calls = [
        SimCall(name="gen", devices=(0,), seconds=3, model="actor"),
        SimCall(name="reward_fn", devices=(), seconds=0, deps=("gen",)),
        SimCall(name="train", devices=(1,), seconds=2, deps=("reward_fn",), model="actor", trains=True),
    ]
    r = simulate(calls, 2, iterations=2)
    assert r.iteration_ends == (5, 10)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="'a' depends on 'b', which comes later"):
        simulate([SimCall(name="a", devices=(0,), seconds=1, deps=("b",)),
                  SimCall(name="b", devices=(0,), seconds=1)], 1)
    with pytest.raises(ValueError, match="uses devices outside 0..1"):
        simulate([SimCall(name="a", devices=(2,), seconds=1)], 2)
