"""Generation under (dp, tp) layouts against transformers ``generate``, and sampling across layouts."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import hf_greedy, hf_logprobs, prompts

from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.replicas import generate_replicated
from shardflow.engine.generate.requests import SamplingParams, make_requests
from shardflow.models.checkpoint import load_model
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout

# (dp, tp) = (1,1), (1,2), (2,1), (2,2), and tp=4 over the tiny models' 2 KV heads.
LAYOUTS = ["d1p1t1@0", "d1p1t2@0-1", "d2p1t1@0-1", "d2p1t2@0-3", "d1p1t4@4-7"]
FAMILIES = {
    "llama": dict(family="llama"),
    "llama3_rope": dict(family="llama3"),
    "mistral_window": dict(family="mistral"),
    "qwen2_bias": dict(family="qwen2", vocab_size=130),  # vocabulary padded over tp
    "qwen3_tied": dict(family="qwen3", tie_word_embeddings=True),
}
NEW_TOKENS = 12
SAMPLES = 2  # greedy samples of one prompt share its prefill and must agree
# float32 on both sides; tp only reorders sums (a few ulps); log-softmax of logits ~1-10.
LOGPROB_ATOL = 1e-4


def generate_job(world, path: str, layout_texts: list[str], prompt_ids: list[list[int]], params: list[dict],
                 samples: int, engine_kwargs: dict):
    layouts = [Layout.parse(t) for t in layout_texts]
    world.create_groups(layouts)
    results = {}
    for layout in layouts:
        if world.rank not in layout:
            continue
        model, _ = load_model(path, layout, world)
        engine = GenerationEngine(model, EngineConfig(**engine_kwargs), eos_token_ids=model.cfg.eos_token_ids)
        requests = make_requests(prompt_ids, [SamplingParams(**p) for p in params], samples)
        done = generate_replicated(engine, layout, world, requests)
        if done is not None:
            results[str(layout)] = [(r.output_ids, r.output_logprobs, r.finish_reason) for r in done]
    return results


def merged(pool, *args) -> dict[str, list]:
    out: dict[str, list] = {}
    for rank_results in pool.run(generate_job, *args):
        out.update(rank_results)
    return out


@pytest.mark.parametrize("case", list(FAMILIES))
def test_greedy_matches_transformers_under_every_layout(pool, checkpoints, case):
    kwargs = dict(FAMILIES[case])
    path = checkpoints.get(case, kwargs.pop("family"), **kwargs)
    ids = prompts(kwargs.get("vocab_size", 128))
    params = [dict(max_new_tokens=NEW_TOKENS, temperature=0.0)] * len(ids)
    # Three slots for four prompts x two samples: later prompts wait for slots to free up.
    results = merged(pool, path, LAYOUTS, ids, params, SAMPLES, dict(max_batch_size=3, max_seq_len=64))
    assert sorted(results) == sorted(LAYOUTS)
    for i, prompt in enumerate(ids):
        expected = hf_greedy(path, prompt, NEW_TOKENS)
        expected_lp = hf_logprobs(path, prompt, expected)
        reason = "stop" if expected[-1] == 2 else "length"
        for layout, outputs in results.items():
            for j in range(SAMPLES):
                tokens, logprobs, finish = outputs[i * SAMPLES + j]
                assert tokens == expected, f"{case} {layout} prompt {i} sample {j}"
                assert finish == reason
                torch.testing.assert_close(torch.tensor(logprobs), expected_lp, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["qwen2_bias", "qwen3_tied"])
def test_transposed_decode_weights_match_transformers(pool, checkpoints, case):
    """Decoding from weights stored transposed (q/k/v and o, gate/up and down, the head; with
    q/k/v biases, a tied and a tp-padded vocabulary) gives transformers' greedy tokens."""
    kwargs = dict(FAMILIES[case])
    path = checkpoints.get(case, kwargs.pop("family"), **kwargs)
    ids = prompts(kwargs.get("vocab_size", 128))
    params = [dict(max_new_tokens=NEW_TOKENS, temperature=0.0)] * len(ids)
    layouts = ["d1p1t1@0", "d1p1t2@0-1"]
    results = merged(pool, path, layouts, ids, params, 1, dict(max_seq_len=64, transposed_weights=True))
    assert sorted(results) == layouts
    for i, prompt in enumerate(ids):
        expected = hf_greedy(path, prompt, NEW_TOKENS)
        expected_lp = hf_logprobs(path, prompt, expected)
        for layout, outputs in results.items():
            tokens, logprobs, _ = outputs[i]
            assert tokens == expected, f"{case} {layout} prompt {i}"
            torch.testing.assert_close(torch.tensor(logprobs), expected_lp, atol=LOGPROB_ATOL, rtol=0)


def test_sampled_tokens_do_not_depend_on_layout_or_batch(pool, checkpoints):
    """Noise is a function of (seed, position, vocabulary index): the same seeds give the same
    tokens under every layout, and a request alone gives what it gave inside a batch."""
    path = checkpoints.get("llama", "llama")
    ids = prompts()
    params = [dict(max_new_tokens=10, temperature=1.0, seed=7),
              dict(max_new_tokens=10, temperature=0.8, top_k=20, seed=7),
              dict(max_new_tokens=10, temperature=1.2, top_p=0.9, seed=3),
              dict(max_new_tokens=10, temperature=0.0)]
    layouts = ["d1p1t1@0", "d1p1t2@0-1", "d2p1t1@2-3", "d1p1t4@4-7"]
    results = merged(pool, path, layouts, ids, params, 3, dict(max_seq_len=64))
    reference = results["d1p1t1@0"]
    assert len({tuple(t) for t, _, _ in reference[:3]}) == 3  # samples of one prompt differ
    for layout in layouts[1:]:
        for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(results[layout], reference):
            assert tokens == ref_tokens, layout
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=LOGPROB_ATOL, rtol=0)
    # Prompts 0-1 without the others (same prompt indices, so the same derived seeds).
    alone = merged(pool, path, ["d1p1t1@0", "d1p1t2@2-3"], ids[:2], params[:2], 3, dict(max_seq_len=64))
    for layout in alone:
        assert [t for t, _, _ in alone[layout][3:6]] == [t for t, _, _ in reference[3:6]], layout


def test_paged_cache_under_tensor_and_data_parallel_layouts(pool, checkpoints):
    """A paged cache too small for the batch on every rank: the ranks of a replica take the same
    block and preemption decisions, and the tokens are those of one rank with a contiguous cache."""
    from shardflow.config.model import ModelConfig
    from shardflow.engine.generate.kv_cache import bytes_per_position
    from shardflow.parallel.sharding import shard_for

    path = checkpoints.get("llama", "llama")
    ids = prompts()
    params = [dict(max_new_tokens=20, temperature=1.0, seed=7), dict(max_new_tokens=16, temperature=0.0)] * 2
    reference = merged(pool, path, ["d1p1t1@0"], ids, params, 3, dict(max_seq_len=64))["d1p1t1@0"]
    layouts = ["d1p1t2@0-1", "d2p1t2@2-5"]
    cfg = ModelConfig.from_pretrained(path)
    # 8 blocks of 16 and the scratch block per rank: 12 requests of 21-50 tokens outgrow it
    budget = 9 * 16 * bytes_per_position(shard_for(cfg, Layout.parse(layouts[0]), 0), cfg, torch.float32)
    results = merged(pool, path, layouts, ids, params, 3,
                     dict(max_seq_len=64, kv_block_size=16, kv_cache_bytes=budget, max_batch_size=12))
    for layout in layouts:
        for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(results[layout], reference):
            assert tokens == ref_tokens, layout
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=LOGPROB_ATOL, rtol=0)


def collectives_job(world, path: str):
    layout = Layout.parse("d1p1t2@0-1")
    world.create_groups([layout])
    if world.rank not in layout:
        return None
    model, _ = load_model(path, layout, world)
    engine = GenerationEngine(model, EngineConfig(max_seq_len=32), eos_token_ids=())
    counts = {}
    for name, params in (("greedy", dict(temperature=0.0)), ("top_k", dict(temperature=1.0, top_k=5))):
        engine.submit(make_requests(prompts()[:2], SamplingParams(max_new_tokens=4, **params)))
        engine.step()  # admission, prefill and a first decode step
        with comm.count_collectives() as counted:
            engine.step()  # a decode step only
        counts[name] = dict(counted)
        engine.generate([])
    return counts


def test_collectives_per_decode_step(pool, checkpoints):
    """tp=2 decode step: the model's all-reduces (embedding, two per layer) and one all-gather
    for sampling (candidates, or the logits when top-k/top-p is on)."""
    path = checkpoints.get("llama", "llama")
    counts = pool.run(collectives_job, path)[0]
    layers = 4
    assert counts["greedy"] == counts["top_k"] == {"all_reduce": 1 + 2 * layers, "all_gather": 1}
