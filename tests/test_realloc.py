"""Parameter reallocation on 8 gloo ranks, checked bitwise against loading the destination layout
straight from the checkpoint; round trips, updates, released sources, message counts, bad input."""

from __future__ import annotations

import pytest
import torch

from shardflow.config.model import ModelConfig
from shardflow.models.checkpoint import load_model
from shardflow.models.reallocate import reallocate_model
from shardflow.models.transformer import build_model
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout
from shardflow.parallel.offload import has_storage
from shardflow.parallel.realloc import reallocate
from shardflow.parallel.realloc_plan import transfer_plan
from shardflow.parallel.sharding import shard_for
from shardflow.parallel.world import World

# (checkpoint, options, layout pairs): identical, overlapping and disjoint rank sets, pp up to 4,
# tp 4 over 2 KV heads (replicated KV), vocabulary padding (qwen2: 130 rows), tied embeddings.
CASES = {
    "qwen2_pad": (dict(family="qwen2", vocab_size=130), {}, [
        ("d1p1t2@0-1", "d2p1t1@0-1"),  # each rank keeps its half and swaps the other
        ("d2p1t1@0-1", "d1p1t2@0-1"),  # purely local
        ("d1p2t2@0-3", "d2p1t2@4-7"),  # disjoint
        ("d2p2t2@0-7", "d1p1t4@2-5"),  # overlapping, tp 4 > 2 KV heads, padded vocabulary
    ]),
    # Tiny buckets and no packing threshold: many rounds, chunked slices and direct messages.
    "llama_tied": (dict(family="llama", tie_word_embeddings=True), dict(bucket_bytes=4096, direct_min_bytes=0), [
        ("d1p1t4@0-3", "d1p4t1@4-7"),  # tied head copied onto the last stage
        ("d1p1t1@0", "d8p1t1@0-7"),  # fan-out from one rank
        ("d4p1t2@0-7", "d1p1t1@3"),  # fan-in from four replicas
        ("d1p2t1@0-1", "d1p2t1@1-2"),  # shifted: rank 1 changes stage
    ]),
    "qwen3_value": (dict(family="qwen3", value_head=True), dict(bucket_bytes=1000, direct_min_bytes=512), [
        ("d2p2t1@0-3", "d1p3t2@2-7"),  # three uneven stages over four layers
        ("d2p1t2@0-3", "d2p1t2@0-3"),  # identical layouts
        ("d1p1t4@0-3", "d2p1t2@1-2,5-6"),
    ]),
}


def params_of(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) if model is not None else None


def mismatches(model, expected: dict[str, torch.Tensor]) -> list[str]:
    got = params_of(model)
    assert sorted(got) == sorted(expected)
    return [n for n, t in got.items() if not torch.equal(t, expected[n])]


@torch.no_grad()
def updated(model, layout: Layout, rank: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """What a model holds after the update ``p = 2 p + 1`` (vocabulary padding rows stay zero)."""
    out = {}
    for name, p in model.named_parameters():
        ts = shard_for(cfg, layout, rank).tensors[name]
        t = torch.zeros_like(p)
        t[ts.local_slices()] = p[ts.local_slices()] * 2 + 1
        out[name] = t
    return out


def realloc_job(world, path: str, pairs: list[tuple[str, str]], options: dict):
    cfg = ModelConfig.from_pretrained(path)
    world.create_groups([Layout.parse(t) for pair in pairs for t in pair])
    me, results = world.rank, {}
    for a_text, b_text in pairs:
        a, b = Layout.parse(a_text), Layout.parse(b_text)
        src = load_model(path, a, world)[0] if me in a else None
        ref_b = load_model(path, b, world)[0] if me in b else None
        r = {}
        # A -> B into a new model, compared with loading B from the checkpoint.
        with comm.count_collectives() as counts:
            dst, r["stats"] = reallocate_model(world, cfg, a, b, src, dtype=torch.float32, **options)
        r["counts"] = dict(counts)
        if me in b:
            r["direct"] = mismatches(dst, params_of(ref_b))
        # B -> A round trip into a new model.
        back, _ = reallocate_model(world, cfg, b, a, dst, dtype=torch.float32, **options)
        if me in a:
            r["round_trip"] = mismatches(back, {n: t.clone() for n, t in src.named_parameters()})
        # An update in A reaches B, reusing B's buffers in place.
        with torch.no_grad():  # real rows only: vocabulary padding stays zero, as in any model
            for name, p in (src.named_parameters() if src is not None else []):
                real = src.shard.tensors[name].local_slices()
                p[real] = p[real] * 2 + 1
        buffers = {n: t.data_ptr() for n, t in params_of(dst).items()} if dst is not None else {}
        same, _ = reallocate_model(world, cfg, a, b, src, dst, **options)
        if me in b:
            assert same is dst and {n: t.data_ptr() for n, t in params_of(dst).items()} == buffers
            r["after_update"] = mismatches(dst, updated(ref_b, b, me, cfg))
        # A temporary B is released after moving back to A; the released A buffers are refilled.
        expected_a = {n: t.clone() for n, t in src.named_parameters()} if src is not None else None
        reallocate_model(world, cfg, a, b, src, dst, release_src=True, **options)
        if me in a:
            r["released"] = not any(has_storage(t) for t in src.parameters())
        reallocate_model(world, cfg, b, a, dst, src, release_src=True, **options)
        if me in a:
            r["refilled"] = mismatches(src, expected_a)
        if me in b and me not in a:
            r["released_b"] = not any(has_storage(t) for t in dst.parameters())
        results[f"{a_text}->{b_text}"] = r
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_reallocation_matches_loading_the_destination(pool, checkpoints, case):
    kwargs, options, pairs = CASES[case]
    kwargs = dict(kwargs)
    path = checkpoints.get(case, kwargs.pop("family"), **kwargs)
    cfg = ModelConfig.from_pretrained(path)
    by_rank = pool.run(realloc_job, path, pairs, options)
    for a_text, b_text in pairs:
        key = f"{a_text}->{b_text}"
        a, b = Layout.parse(a_text), Layout.parse(b_text)
        results = {rank: res[key] for rank, res in enumerate(by_rank)}
        for rank in b.ranks:
            r = results[rank]
            assert r["direct"] == [] and r["after_update"] == [], (key, rank, r)
            if rank not in a:
                assert r["released_b"], (key, rank)
        for rank in a.ranks:
            assert results[rank]["round_trip"] == [] and results[rank]["refilled"] == [], (key, rank, results[rank])
            assert results[rank]["released"], (key, rank)
        # Bytes reported by the ranks add up to the plan, which is at its lower bound.
        plan = transfer_plan(cfg, a, b)
        stats = [results[r]["stats"] for r in range(len(by_rank))]
        assert sum(s.bytes_received for s in stats) == sum(s.bytes_sent for s in stats) == plan.received_numel * 4
        assert plan.received_numel == plan.lower_bound_numel
        assert sum(s.bytes_copied for s in stats) == plan.local_numel * 4
        posted = sum(sum(results[r]["counts"].values()) for r in range(len(by_rank)))
        assert posted == sum(s.messages for s in stats)


def test_one_message_per_pair_and_direction_with_default_buckets(pool, checkpoints):
    """A tiny model fits in one bucket: d1t2 -> d2t1 posts exactly one send and one receive per rank."""
    path = checkpoints.get("qwen2_pad", "qwen2", vocab_size=130)
    pair = ("d1p1t2@0-1", "d2p1t1@0-1")
    results = pool.run(realloc_job, path, [pair], {})
    for rank in (0, 1):
        assert results[rank][f"{pair[0]}->{pair[1]}"]["counts"] == {"isend": 1, "irecv": 1}


# ----- bad input: clear errors before any communication (no process group exists here) -------


def single_rank_world() -> World:
    return World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")


def test_bad_input_is_named_before_communicating(checkpoints):
    path = checkpoints.get("qwen2_pad", "qwen2", vocab_size=130)
    other = checkpoints.get("llama_tied", "llama", tie_word_embeddings=True)
    cfg, other_cfg = ModelConfig.from_pretrained(path), ModelConfig.from_pretrained(other)
    world, one = single_rank_world(), Layout((0,))
    model = load_model(path, one, world)[0]
    params = dict(model.named_parameters())

    with pytest.raises(ValueError, match="the source model is a different model"):
        reallocate_model(world, other_cfg, one, one, model, dtype=torch.float32)
    with pytest.raises(ValueError, match="source model on rank 0 is laid out as d1p1t1@0, not d1p1t2@0-1"):
        reallocate_model(world, cfg, Layout.contiguous(tp=2), one, model, dtype=torch.float32)
    fresh = build_model(cfg, shard_for(cfg, one, 0), None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="rank 0 is in the source layout d1p1t1@0 but was given no source"):
        reallocate_model(world, cfg, one, one, None, fresh)
    with pytest.raises(ValueError, match="needs pp\\*dp\\*tp = 1\\*1\\*2 = 2 ranks, got 3"):
        Layout.parse("d1p1t2@0-2")
    with pytest.raises(ValueError, match="tp=3 cannot split 4 attention heads"):
        reallocate(world, cfg, one, Layout.contiguous(tp=3), params, None)
    with pytest.raises(ValueError, match="names rank 1, but the job has 1 ranks"):
        reallocate(world, cfg, one, Layout.contiguous(tp=2), params, None)
    wrong = {**dict(fresh.named_parameters()), "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="destination tensor 'model.norm.weight' on rank 0 has shape \\[3\\]"):
        reallocate(world, cfg, one, one, params, wrong)
    with pytest.raises(ValueError, match="do not match d1p1t1@0 of this model"):
        reallocate(world, cfg, one, one, params, {n: t for n, t in params.items() if "norm" not in n})
    with pytest.raises(ValueError, match="shares memory with source tensor"):
        reallocate(world, cfg, one, one, params, params)
    with pytest.raises(ValueError, match="mix dtypes"):
        reallocate(world, cfg, one, one, params, {n: t.double() for n, t in params.items()})
