"""The reallocation plan as a pure function: applied to known full tensors it rebuilds every
destination slice exactly, moves no more than the lower bound, and spreads the sending."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.config.model import ModelConfig, RopeConfig
from shardflow.parallel.layout import Layout
from shardflow.parallel.realloc_plan import transfer_plan
from shardflow.parallel.sharding import check_layout, checkpoint_tensor_names, shard_for

MAX_RANKS = 8


def config(**overrides) -> ModelConfig:
    values = dict(architecture="LlamaForCausalLM", family="llama", vocab_size=130, hidden_size=32,
                  intermediate_size=64, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=4,
                  rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4), max_position_embeddings=64)
    values.update(overrides)
    return ModelConfig(**values)


MODELS = {
    # vocab 130 is padded for tp 4 and 8; tp 4 and 8 exceed the 2 KV heads (replicated KV).
    "llama_pad": config(),
    # tied head: a copy of the embedding on the last stage when pp > 1; vocab 13 over tp 8 leaves
    # ranks with no real vocabulary rows at all.
    "llama_tied": config(vocab_size=13, tie_word_embeddings=True, num_layers=2),
    # Qwen2 biases, one KV head (replicated for every tp > 1), tied head.
    "qwen2_bias": config(architecture="Qwen2ForCausalLM", family="qwen2", qkv_bias=True, num_heads=4,
                         num_kv_heads=1, head_dim=8, tie_word_embeddings=True),
    # Qwen3 q/k norms and a value head instead of the LM head.
    "qwen3_value": config(architecture="Qwen3ForSequenceClassification", family="qwen3", qk_norm=True,
                          value_head=True, num_layers=4),
}


def valid_shapes(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    shapes = []
    for pp in range(1, MAX_RANKS + 1):
        for dp in range(1, MAX_RANKS + 1):
            for tp in range(1, MAX_RANKS + 1):
                if pp * dp * tp > MAX_RANKS:
                    continue
                try:
                    check_layout(cfg, Layout.contiguous(pp=pp, dp=dp, tp=tp))
                except ValueError:
                    continue
                shapes.append((pp, dp, tp))
    return shapes


@st.composite
def layouts(draw, cfg: ModelConfig) -> Layout:
    pp, dp, tp = draw(st.sampled_from(valid_shapes(cfg)))
    ranks = draw(st.lists(st.integers(0, MAX_RANKS - 1), min_size=pp * dp * tp, max_size=pp * dp * tp,
                          unique=True))
    return Layout(tuple(sorted(ranks)), pp=pp, dp=dp, tp=tp)


@st.composite
def layout_pairs(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    cfg = MODELS[name]
    return name, draw(layouts(cfg)), draw(layouts(cfg))


def full_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor with values unique across the whole model."""
    ref = shard_for(cfg, Layout((0,)), 0).tensors
    tensors, offset = {}, 0
    for name in checkpoint_tensor_names(cfg):
        shape = ref[name].full_shape
        n = torch.Size(shape).numel()
        tensors[name] = torch.arange(offset, offset + n, dtype=torch.int64).reshape(shape)
        offset += n
    return tensors


def local_tensors(cfg, layout, rank, full, fill: int) -> dict[str, torch.Tensor]:
    """A rank's local tensors: its slices of ``full``, padding rows set to ``fill``."""
    out = {}
    for name, ts in shard_for(cfg, layout, rank).tensors.items():
        t = torch.full(ts.local_shape, fill, dtype=torch.int64)
        t[ts.local_slices()] = full[ts.source][ts.full_slices()]
        out[name] = t
    return out


def check_plan(cfg: ModelConfig, src: Layout, dst: Layout) -> None:
    plan = transfer_plan(cfg, src, dst)
    full = full_tensors(cfg)
    src_local = {r: local_tensors(cfg, src, r, full, fill=-1) for r in src.ranks}
    dst_local, writes = {}, {}
    for r in dst.ranks:
        shard = shard_for(cfg, dst, r)
        dst_local[r] = {n: torch.full(ts.local_shape, -2, dtype=torch.int64) for n, ts in shard.tensors.items()}
        writes[r] = {n: torch.zeros(ts.local_shape, dtype=torch.int64) for n, ts in shard.tensors.items()}

    for t in plan.transfers:
        assert t.src_rank in src and t.dst_rank in dst
        piece = t.src_view(src_local[t.src_rank][t.src_name])
        assert tuple(piece.shape) == t.shape and piece.numel() == t.numel
        t.dst_view(dst_local[t.dst_rank][t.name]).copy_(piece)
        t.dst_view(writes[t.dst_rank][t.name]).add_(1)

    # Independent lower bound, element by element: what each destination needs and did not hold.
    need_total = held_total = 0
    for r in dst.ranks:
        held_shards = {ts.source: ts for ts in shard_for(cfg, src, r).tensors.values()} if r in src else {}
        for name, ts in shard_for(cfg, dst, r).tensors.items():
            expected = full[ts.source][ts.full_slices()]
            got = dst_local[r][name]
            assert torch.equal(got[ts.local_slices()], expected), (r, name)
            count = writes[r][name]
            assert bool((count[ts.local_slices()] == 1).all()), f"{name} on {r}: not written exactly once"
            assert int(count.sum()) == expected.numel(), f"{name} on {r}: padding written"
            need = torch.zeros(ts.full_shape, dtype=torch.bool)
            need[ts.full_slices()] = True
            held = torch.zeros(ts.full_shape, dtype=torch.bool)
            if ts.source in held_shards:
                held[held_shards[ts.source].full_slices()] = True
            need_total += int((need & ~held).sum())
            held_total += int((need & held).sum())
    assert plan.received_numel == need_total == plan.lower_bound_numel
    assert plan.local_numel == held_total
    assert all(t.local == (t.src_rank == t.dst_rank) for t in plan.transfers)


@settings(max_examples=150, deadline=None)
@given(layout_pairs())
def test_plan_rebuilds_every_destination_slice_at_the_lower_bound(case):
    name, src, dst = case
    check_plan(MODELS[name], src, dst)


@pytest.mark.parametrize("name,src,dst", [
    ("llama_pad", "d1p1t1@0", "d1p1t8@0-7"),  # tp 8 > 2 KV heads, vocab padding on the last ranks
    ("llama_tied", "d1p2t4@0-7", "d1p1t8@0-7"),  # tied head copy serves the embedding, empty vocab pieces
    ("llama_tied", "d1p1t1@3", "d1p2t2@0-3"),
    ("qwen2_bias", "d2p2t2@0-7", "d1p3t1@1,4,6"),
    ("qwen3_value", "d4p1t2@0-7", "d4p1t2@0-7"),  # identical layouts: all local
])
def test_plan_edge_cases(name, src, dst):
    check_plan(MODELS[name], Layout.parse(src), Layout.parse(dst))


def test_identical_layouts_copy_locally_and_plans_are_cached():
    cfg = MODELS["llama_pad"]
    a = Layout.parse("d2p1t2@0-3")
    plan = transfer_plan(cfg, a, a)
    assert plan.received_numel == 0 and all(t.local for t in plan.transfers)
    assert transfer_plan(cfg, a, a) is plan


def test_sending_is_spread_over_source_replicas():
    """Disjoint destination: every byte crosses the network; four replicas share the sending."""
    cfg = MODELS["llama_pad"]
    plan = transfer_plan(cfg, Layout.parse("d4p1t1@0-3"), Layout.parse("d1p1t2@4-5"))
    sent = plan.sent_numel_by_rank
    largest = max(t.numel for t in plan.transfers)
    average = plan.received_numel / 4
    assert all(abs(n - average) <= largest for n in sent.values()), sent
    # Overlapping ranks: rank 0 keeps its tp-0 half; both holders of the tp-1 half (ranks 1 and 3)
    # send the rest, and rank 2 (another copy of what rank 0 holds) sends nothing.
    plan = transfer_plan(cfg, Layout.parse("d2p1t2@0-3"), Layout.parse("d1p1t1@0"))
    sent = plan.sent_numel_by_rank
    assert plan.local_numel > 0 and sent[0] == sent[2] == 0
    assert abs(sent[1] - sent[3]) <= max(t.numel for t in plan.transfers), sent


def test_tp_replicated_kv_heads_are_served_by_several_ranks():
    """tp 8 over 2 KV heads: four ranks hold each KV head; all of them help a new replica."""
    cfg = MODELS["llama_pad"]
    plan = transfer_plan(cfg, Layout.parse("d1p1t8@0-7"), Layout.parse("d2p1t1@0,4"))
    k_senders = {t.src_rank for t in plan.transfers if "k_proj" in t.name and not t.local}
    assert len(k_senders) > 1


def test_layouts_the_model_cannot_take_are_named():
    cfg = MODELS["llama_pad"]
    with pytest.raises(ValueError, match="tp=3 cannot split 8 attention heads"):
        transfer_plan(cfg, Layout.contiguous(tp=3), Layout.contiguous(tp=1))
    with pytest.raises(ValueError, match="pp=4 exceeds the 3 layers"):
        transfer_plan(cfg, Layout.contiguous(tp=1), Layout.contiguous(pp=4))
    with pytest.raises(ValueError, match="destination layout must be a Layout"):
        transfer_plan(cfg, Layout.contiguous(tp=1), "d1p1t1@0")
