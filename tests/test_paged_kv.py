"""The paged KV cache: block accounting, and generation through it against the contiguous cache
(the same tokens and log-probabilities), shared prompt blocks, and preemption when requests
outgrow the cache."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import hf_greedy, local_model, prompts

from shardflow.config.model import ModelConfig
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.kv_cache import KVCache, bytes_per_position
from shardflow.engine.generate.requests import SamplingParams, make_requests
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for

BLOCK = 16


@pytest.fixture(scope="module")
def llama(checkpoints):
    path = checkpoints.get("llama", "llama")
    return path, local_model(path)


def block_bytes(model) -> int:
    return bytes_per_position(model.shard, model.cfg, torch.float32) * BLOCK


def generate(model, requests, **config):
    engine = GenerationEngine(model, EngineConfig(**config), eos_token_ids=(2,))
    engine.generate(requests)
    return engine


def workload():
    """Three prompts (11, 23, 30 tokens) x 3 samples, greedy and sampled, 6-20 new tokens."""
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=7) for n, t in ((20, 0.0), (14, 1.0), (6, 1.0))]
    return make_requests(prompts()[1:], params, 3)


def assert_same(got, want):
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason, a.request_id
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5,
                                   rtol=0)


def test_block_accounting():
    from shardflow.models.tiny import tiny_hf_config

    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama").to_dict())
    shard = shard_for(cfg, Layout((0,)), 0)
    per_block = bytes_per_position(shard, cfg, torch.float32) * BLOCK
    cache = KVCache.for_model(cfg, shard, budget_bytes=8 * per_block, max_len=60, max_slots=5, dtype=torch.float32,
                              device="cpu", block_size=BLOCK)
    assert cache.paged and cache.num_blocks == 7 and cache.blocks_per_slot == 4 and cache.num_slots == 5
    assert cache.k[0].shape[0] == 8 and cache.k[0].shape[2] == BLOCK  # the scratch block last
    a, b, c = cache.allocate(3)
    assert cache.ensure([a], [40]) and cache.blocks_of(a) == [0, 1, 2]
    cache.share(a, [b, c], 40)  # the two whole blocks of a 40-token prompt
    assert cache.blocks_of(b) == [0, 1] and cache.ensure([b, c], [41, 41])
    assert cache.blocks_of(b) == [0, 1, 3] and cache.blocks_of(c) == [0, 1, 4] and cache.num_free_blocks == 2
    assert cache.table[b].tolist() == [0, 1, 3, cache.scratch_block]
    assert not cache.ensure([a, b, c], [60] * 3) and cache.blocks_of(a) == [0, 1, 2]  # all or nothing
    cache.release(a)  # blocks 0 and 1 stay: b and c share them
    assert cache.num_free_blocks == 3 and cache.table[a].tolist() == [cache.scratch_block] * 4
    cache.release(b)
    cache.release(c)
    assert cache.num_free_blocks == 7 and cache.num_free == 5
    with pytest.raises(ValueError, match="fewer than one sequence of 60 tokens needs"):
        KVCache.for_model(cfg, shard, budget_bytes=4 * per_block, max_len=60, max_slots=5, dtype=torch.float32,
                          device="cpu", block_size=BLOCK)
    with pytest.raises(ValueError, match="kv_block_size must be a positive multiple of 16"):
        EngineConfig(kv_block_size=24)


def test_paged_generation_gives_the_contiguous_tokens(llama):
    path, model = llama
    want = workload()
    contiguous = generate(model, want, max_seq_len=64, max_batch_size=9)
    got = workload()
    seen = []  # blocks in use after each step
    engine = GenerationEngine(model, EngineConfig(max_seq_len=64, max_batch_size=9, kv_block_size=BLOCK),
                              eos_token_ids=(2,))
    engine.submit(got)
    while engine.busy:
        engine.step()
        seen.append(engine.cache.num_blocks - engine.cache.num_free_blocks)
    assert_same(got, want)
    assert got[0].output_ids == hf_greedy(path, prompts()[1], 20)
    assert engine.stats.preemptions == 0 and engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.stats.prefill_tokens == contiguous.stats.prefill_tokens  # one prefill per prompt
    # Live tokens only: at the first step, each prompt's whole blocks once (0, 1, 1 of them) and
    # each sample's own last block (9), against 9 slots x 4 blocks reserved by the contiguous cache.
    assert seen[0] == 11 and max(seen) < 9 * 4


def test_requests_outgrowing_the_cache_complete_by_preemption(llama):
    """A cache of 9 blocks (two sequences of 64) for 9 requests: they are preempted as they grow,
    recomputed when admitted again, and end with the tokens of an ample cache."""
    _, model = llama
    want = workload()
    generate(model, want, max_seq_len=64, max_batch_size=9)
    got = workload()
    engine = generate(model, got, max_seq_len=64, max_batch_size=9, kv_block_size=BLOCK,
                      kv_cache_bytes=10 * block_bytes(model))
    assert engine.cache.num_blocks == 9 and engine.stats.preemptions > 0
    assert_same(got, want)
    assert engine.cache.num_free_blocks == 9 and engine.cache.num_free == 9


def test_a_prompt_group_larger_than_the_cache_is_split(llama):
    """Eight samples of a 30-token prompt where the cache holds six 2-block sequences: the group
    is admitted in parts that fit, and every sample gets the tokens it would get in one part."""
    _, model = llama
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    want = make_requests([prompts()[3]], params, 8)
    generate(model, want, max_seq_len=48, max_batch_size=8)
    got = make_requests([prompts()[3]], params, 8)
    engine = generate(model, got, max_seq_len=48, max_batch_size=8, kv_block_size=BLOCK,
                      kv_cache_bytes=8 * block_bytes(model))
    assert engine.cache.num_blocks == 7 and engine.stats.prefill_tokens > len(prompts()[3])  # more than one prefill
    assert_same(got, want)


def test_a_paged_cache_regroups_by_block():
    """Half the heads per block: block b's heads [2j, 2j + 2) are block 2b + j of the view, in the
    same memory; the view has as many slots as a contiguous regroup would, all free."""
    cache = KVCache.zeros(layers=(0,), num_slots=3, num_kv_heads=4, max_len=40, head_dim=2, dtype=torch.float32,
                          device="cpu", block_size=BLOCK, num_blocks=5)
    cache.k[0].copy_(torch.arange(cache.k[0].numel(), dtype=torch.float32).view_as(cache.k[0]))
    half = cache.regroup(2)
    assert half.paged and half.num_blocks == 11 and half.num_slots == 7 and half.max_len == 40
    for b in range(6):
        for j in range(2):
            assert torch.equal(half.k[0][b * 2 + j], cache.k[0][b, 2 * j: 2 * j + 2])
    assert half.k[0].untyped_storage().data_ptr() == cache.k[0].untyped_storage().data_ptr()
    assert half.num_free_blocks == 11 and half.table[half.scratch_slot].eq(half.scratch_block).all()
    [slot] = cache.allocate(1)
    assert cache.ensure([slot], [40])
    cache.release_all()  # forgets the requests, keeps the data
    assert cache.num_free == 3 and cache.num_free_blocks == 5 and cache.table.eq(cache.scratch_block).all()
