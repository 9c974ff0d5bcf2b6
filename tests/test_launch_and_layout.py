"""Launcher failure handling, layouts as values, and the sharding spec as pure functions."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardflow.config.model import ModelConfig
from shardflow.models.tiny import tiny_hf_config
from shardflow.parallel.launch import RankFailed, launch
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import padded_vocab_size, shard_for, stage_layers


def _rank_one_fails(world) -> None:
    if world.rank == 1:
        raise KeyError("boom from rank one")
    dist.barrier()  # rank 0 waits on a peer that will never come


def test_failing_rank_ends_the_job_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(_rank_one_fails, 2, backend="gloo")
    assert "rank 1 failed" in str(info.value) and "boom from rank one" in str(info.value)
    assert "_rank_one_fails" in str(info.value)  # the traceback, not just the message
    assert time.monotonic() - start < 90  # spawning two torch processes dominates


def _rank_one_is_killed(world) -> None:
    dist.barrier()
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as ``kill -9`` from outside: no report, no teardown
    for _ in range(1000):  # the others talk to it until their connection breaks
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)


def test_the_rank_that_died_first_is_named_and_the_others_follow():
    with pytest.raises(RankFailed) as info:
        launch(_rank_one_is_killed, 3, backend="gloo")
    text = str(info.value)
    assert text.startswith("rank 1 died from signal SIGKILL"), text
    assert "then, in the order they failed:" in text and "rank 0:" in text and "rank 2:" in text, text


def test_layout_round_trips_and_groups():
    layout = Layout.parse("d2p2t2@0-7")
    assert str(layout) == "d2p2t2@0-7" and layout == Layout.contiguous(pp=2, dp=2, tp=2)
    assert Layout.parse("d1p1t2@0,2") == Layout((0, 2), tp=2)
    assert layout.tp_group(5) == (4, 5) and layout.dp_group(5) == (5, 7) and layout.pp_group(5) == (1, 5)
    assert layout.coord(6).pp == 1 and layout.coord(6).dp == 1 and layout.coord(6).tp == 0
    assert layout.replica_ranks(1) == (2, 3, 6, 7)
    assert len({layout, Layout.parse(str(layout))}) == 1
    with pytest.raises(ValueError, match="each tp group must increase"):
        Layout((1, 0), tp=2)
    interleaved = Layout.parse("d2p1t2@0,2,1,3")
    assert interleaved.tp_group(2) == (0, 2) and interleaved.dp_group(1) == (0, 1)
    assert str(interleaved) == "d2p1t2@0,2,1,3"
    with pytest.raises(ValueError, match="cannot parse layout"):
        Layout.parse("t2d1")


def config(**overrides) -> ModelConfig:
    hf = tiny_hf_config("llama", **overrides)
    return ModelConfig.from_hf_dict(hf.to_dict())


def test_stages_are_contiguous_balanced_and_cover_every_layer():
    cfg = config(num_hidden_layers=10, vocab_size=128)
    for pp in range(1, 11):
        stages = stage_layers(cfg, pp)
        assert [i for s in stages for i in s] == list(range(10)) and all(stages)
        assert max(len(s) for s in stages) - min(len(s) for s in stages) <= 1
    # A huge vocabulary makes the head stage take fewer layers.
    big = config(num_hidden_layers=8, vocab_size=64 * 1024)
    stages = stage_layers(big, 2)
    assert len(stages[1]) < len(stages[0])


def test_every_tensor_slice_is_covered_exactly_once_per_replica():
    """Per replica, the tp shards of each tensor tile the full tensor exactly (or replicate it)."""
    for tp, kv, vocab in [(1, 2, 128), (2, 2, 130), (4, 2, 130), (4, 4, 128)]:
        cfg = config(num_key_value_heads=kv, vocab_size=vocab)
        layout = Layout.contiguous(pp=2, dp=2, tp=tp)
        for d in range(2):
            covered: dict[str, list[tuple[int, int]]] = {}
            for r in layout.replica_ranks(d):
                for ts in shard_for(cfg, layout, r).tensors.values():
                    covered.setdefault(ts.source, []).append((ts.start, ts.stop) if ts.dim is not None else None)
            for name, pieces in covered.items():
                if None in pieces:
                    continue
                distinct = sorted(set(pieces))
                full = shard_for(cfg, Layout((0,)), 0).tensors[name].full_shape
                ts0 = next(ts for r in layout.replica_ranks(d) for n, ts in shard_for(cfg, layout, r).tensors.items()
                           if ts.source == name)
                bounds = [0] + [b for a, b in distinct]
                assert [a for a, b in distinct] == bounds[:-1] and bounds[-1] == full[ts0.dim], (tp, name, distinct)
        assert padded_vocab_size(cfg, tp) % tp == 0


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    cfg = config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    layout = Layout.contiguous(tp=8)
    heads = [shard_for(cfg, layout, r).kv_head_start for r in range(8)]
    assert heads == [0, 0, 0, 0, 1, 1, 1, 1]
    ts = shard_for(cfg, layout, 5).tensors["model.layers.0.self_attn.k_proj.weight"]
    assert ts.partial_grad_tp == (4, 5, 6, 7)
