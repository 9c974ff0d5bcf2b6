"""Batch redistribution: every sample arrives exactly once, intact, on every rank of one consumer
replica, with shares balanced by tokens; the assignment is tested as a pure function too."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.data.batch import SequenceBatch
from shardflow.parallel.layout import Layout
from shardflow.parallel.redistribute import assign_shares, redistribute, redistribute_groups, source_holders
from shardflow.parallel.world import World

# (source layout, destination layout, sequences per source replica, keep_together)
PAIRS = [
    ("d2p2t1@0-3", "d3p1t2@2-7", 7, None),  # holders 2, 3; overlapping ranks
    ("d1p1t4@0-3", "d2p1t1@4-5", 9, None),  # one holder, disjoint consumers
    ("d4p1t2@0-7", "d1p2t2@0-3", 3, "group"),  # four holders into one pipelined replica
    ("d2p1t1@0-1", "d2p1t1@0-1", 5, "group"),  # same layout: holders keep most of their own data
    ("d1p1t1@5", "d8p1t1@0-7", 5, None),  # fewer sequences than replicas: some shares are empty
]


def make_batch(replica: int, count: int) -> SequenceBatch:
    """A holder's outputs: ids, per-token float and [T, 2] fields, per-sequence fields, meta."""
    g = torch.Generator().manual_seed(100 + replica)
    lengths = torch.randint(1, 20, (count,), generator=g).tolist()
    ids = [1000 * replica + i for i in range(count)]
    tokens = {
        "input_ids": [torch.randint(0, 128, (n,), generator=g) for n in lengths],
        "logprobs": [torch.randn(n, generator=g) for n in lengths],
        "loss_mask": [torch.rand(n, generator=g) > 0.5 for n in lengths],
        "pair": [torch.randn(n, 2, generator=g).double() for n in lengths],
    }
    seq = {"reward": torch.randn(count, generator=g),
           "group": torch.tensor([1000 * replica + i // 2 for i in range(count)])}
    return SequenceBatch.from_lists(ids, tokens, seq, {"answer": [f"answer {i}" for i in ids]})


def redistribute_job(world, pairs):
    world.groups.create(g for src, dst, _, _ in pairs
                        for g in redistribute_groups(Layout.parse(src), Layout.parse(dst)))
    out = {}
    for src_text, dst_text, count, keep in pairs:
        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        batch = None
        if world.rank in source_holders(src):
            batch = make_batch(src.coord(world.rank).dp, count)
        elif world.rank in src:
            batch = "not a holder: ignored"
        share = redistribute(world, batch, src, dst, keep_together=keep)
        out[src_text + "->" + dst_text] = share
    return out


def test_every_sample_arrives_once_and_intact_on_its_replica(pool):
    by_rank = pool.run(redistribute_job, PAIRS)
    for src_text, dst_text, count, keep in PAIRS:
        src, dst = Layout.parse(src_text), Layout.parse(dst_text)
        key = src_text + "->" + dst_text
        original = SequenceBatch.concat(make_batch(d, count) for d in range(src.dp))
        for rank, res in enumerate(by_rank):
            assert (res[key] is None) == (rank not in dst), (key, rank)
        shares = []
        for j in range(dst.dp):
            ranks = dst.replica_ranks(j)
            share = by_rank[ranks[0]][key]
            for r in ranks[1:]:  # every rank of a replica gets the same share
                other = by_rank[r][key]
                assert torch.equal(other.sample_ids, share.sample_ids)
                for name, t in share.token_fields.items():
                    assert torch.equal(other.token_fields[name], t)
            shares.append(share)
        got = SequenceBatch.concat(shares)
        assert sorted(got.sample_ids.tolist()) == sorted(original.sample_ids.tolist())  # exactly once
        got, want = got.sorted_by_id(), original.sorted_by_id()
        assert torch.equal(got.lengths, want.lengths) and got.meta == want.meta
        for name, t in want.token_fields.items():
            assert got.token_fields[name].dtype == t.dtype and torch.equal(got.token_fields[name], t), name
        for name, t in want.seq_fields.items():
            assert torch.equal(got.seq_fields[name], t), name
        tokens = [s.num_tokens for s in shares]
        assert max(tokens) - min(tokens) <= (2 if keep else 1) * 19, tokens  # at most the largest unit
        if keep:
            where = {g: j for j, s in enumerate(shares) for g in s.seq_fields[keep].tolist()}
            for j, s in enumerate(shares):
                assert all(where[g] == j for g in s.seq_fields[keep].tolist())
        for s in shares:  # empty shares keep the schema
            assert set(s.token_fields) == set(want.token_fields) and set(s.meta) == set(want.meta)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), max_size=12), min_size=1, max_size=4), st.integers(1, 6),
       st.booleans())
def test_assignment_covers_each_sequence_once_and_balances_tokens(lengths, replicas, grouped):
    keys = [[(h, i // 3) for i in range(len(row))] for h, row in enumerate(lengths)] if grouped else None
    shares = assign_shares(lengths, replicas, keys)
    placed = sorted(x for s in shares for x in s)
    assert placed == [(h, i) for h, row in enumerate(lengths) for i in range(len(row))]
    step = 3 if grouped else 1
    unit = max((sum(row[i:i + step]) for row in lengths for i in range(0, len(row), step)), default=0)
    loads = [sum(lengths[h][i] for h, i in s) for s in shares]
    assert max(loads) - min(loads) <= unit
    assert all(s == sorted(s) for s in shares)
    if grouped:
        home = {}
        for j, s in enumerate(shares):
            for h, i in s:
                assert home.setdefault(keys[h][i], j) == j


def test_groups_and_holders():
    src, dst = Layout.parse("d2p2t2@0-7"), Layout.parse("d1p1t2@0-1")
    assert source_holders(src) == (4, 6)
    assert redistribute_groups(src, dst) == [(0, 1, 4, 6)]
    assert redistribute_groups(Layout.parse("d1p1t1@3"), Layout.parse("d1p1t1@3")) == []


def test_bad_input_is_named_before_communicating():
    world = World(rank=0, size=2, device=torch.device("cpu"), backend="gloo")
    one = Layout((0,))
    with pytest.raises(ValueError, match="but was given NoneType, not a SequenceBatch"):
        redistribute(world, None, one, Layout((0, 1), dp=2))
    with pytest.raises(ValueError, match="names rank 2, but the job has 2 ranks"):
        redistribute(world, make_batch(0, 2), one, Layout((0, 2), dp=2))
    with pytest.raises(ValueError, match="keep_together field 'nope' is not a sequence or meta field"):
        redistribute(world, make_batch(0, 2), one, Layout((0, 1), dp=2), keep_together="nope")


def test_assignment_depends_only_on_the_samples_not_their_holders():
    """Outputs of different producers (other holders, other order) for the same samples must land
    on the same replicas, so that a call's inputs can be joined by sample id."""
    ids = list(range(12))
    lengths = {i: 3 + (i * 7) % 5 for i in ids}
    a = [ids[:5], ids[5:]]
    b = [ids[9:], ids[3:9][::-1], ids[:3]]
    def replicas_of(split):
        shares = assign_shares([[lengths[i] for i in row] for row in split], 3, ids=split)
        return {split[h][i]: j for j, share in enumerate(shares) for h, i in share}
    assert replicas_of(a) == replicas_of(b)
