"""The engine loop on one rank: how requests end, KV slots, waiting, recompute, and refusals."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import hf_greedy, hf_logprobs, local_model, prompts
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from shardflow.config.model import ModelConfig
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.kv_cache import KVCache, bytes_per_slot
from shardflow.engine.generate.requests import Request, SamplingParams, derive_seed, make_requests, to_sequence_batch
from shardflow.engine.generate.sampling import pick
from shardflow.engine.generate.steps import decode_end, decode_layer, decode_start
from shardflow.models.transformer import build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llama(checkpoints):
    path = checkpoints.get("llama", "llama")
    return path, local_model(path)


def run(model, prompt_ids, *, config=EngineConfig(max_seq_len=64), eos=(2,), **params):
    engine = GenerationEngine(model, config, eos_token_ids=eos)
    requests = make_requests(prompt_ids, SamplingParams(**params))
    engine.generate(requests)
    return requests, engine


def test_requests_end_on_stop_tokens_eos_length_and_context(llama):
    path, model = llama
    prompt = prompts()[1]
    expected = hf_greedy(path, prompt, 12, eos=None)
    assert len(set(expected[:4])) == 4  # distinct early tokens make the cases below unambiguous

    [r], _ = run(model, [prompt], max_new_tokens=12, stop_token_ids=(expected[3],), **GREEDY)
    assert r.output_ids == expected[:4] and r.finish_reason == "stop"

    [r], _ = run(model, [prompt], eos=(expected[2],), max_new_tokens=12, **GREEDY)  # EOS stops...
    assert r.output_ids == expected[:3] and r.finish_reason == "stop"
    [r], _ = run(model, [prompt], eos=(expected[2],), max_new_tokens=12, ignore_eos=True, **GREEDY)  # ...unless ignored
    assert r.output_ids == expected and r.finish_reason == "length"

    [r], _ = run(model, [prompt], max_new_tokens=1, **GREEDY)  # ends right after prefill
    assert r.output_ids == expected[:1] and r.finish_reason == "length"

    context = EngineConfig(max_seq_len=len(prompt) + 4)
    [r], _ = run(model, [prompt], config=context, max_new_tokens=12, eos=(), **GREEDY)
    assert r.output_ids == expected[:4] and r.finish_reason == "context"
    with pytest.raises(ValueError, match="leave no room"):
        run(model, [prompt + [5] * 4], config=context, max_new_tokens=12)


def test_the_host_reads_each_step_while_the_next_one_runs(llama):
    """A step launches the next decode step before reading back the previous one's tokens, so the
    requests lag the device by one step until ``flush``. A request that stops on EOS costs one
    extra row (its next step was launched before its EOS was read), one that ends by length none."""
    path, model = llama
    prompt = prompts()[1]
    expected = hf_greedy(path, prompt, 12, eos=None)
    end = next(i for i in range(2, 12) if expected[i] not in expected[:i])  # the first new token from the 3rd on

    [r], engine = run(model, [prompt], eos=(expected[end],), max_new_tokens=12, **GREEDY)
    assert r.output_ids == expected[:end + 1] and r.finish_reason == "stop"
    assert [b for b, _ in engine.stats.decode_steps] == [1] * (end + 1)  # end useful steps, one wasted
    assert engine.stats.generated_tokens == end + 1 and engine.cache.num_free == engine.cache.num_slots
    [r], engine = run(model, [prompt], eos=(), max_new_tokens=end + 1, **GREEDY)
    assert r.output_ids == expected[:end + 1] and len(engine.stats.decode_steps) == end  # none wasted

    engine = GenerationEngine(model, EngineConfig(max_seq_len=64), eos_token_ids=())
    [r] = make_requests([prompt], SamplingParams(max_new_tokens=12, **GREEDY))
    engine.submit([r])
    engine.step()  # prefill (the first token), then decode step 1 launched
    assert r.output_ids == expected[:1] and engine.in_flight == 1
    engine.step()  # step 2 launched, step 1 read
    assert r.output_ids == expected[:2] and engine.in_flight == 1
    with pytest.raises(RuntimeError, match="decode step in flight"):
        engine.release_cache()
    with pytest.raises(RuntimeError, match="decode step in flight"):
        engine.adopt([])
    engine.flush()
    assert r.output_ids == expected[:3] and engine.in_flight == 0 and r.cached_len == len(prompt) + 2
    engine.step()  # inputs from the host again
    [left] = engine.evict()  # reads the step in flight first
    assert left is r and r.output_ids == expected[:4] and r.slot is None and not engine.busy
    engine.generate([r])  # recomputes its KV and goes on
    assert r.output_ids == expected and r.finish_reason == "length"


def test_requests_wait_for_slots_and_the_batch_shrinks_as_they_finish(llama):
    path, model = llama
    ids = prompts(lengths=(5, 9, 13, 7, 11))
    lengths = [3, 9, 5, 7, 4]
    max_len = 63
    budget = 3 * bytes_per_slot(model.shard, model.cfg, max_len, torch.float32)  # two slots + scratch
    engine = GenerationEngine(model, EngineConfig(max_seq_len=64, kv_cache_bytes=budget), eos_token_ids=())
    assert engine.cache.num_slots == 2
    requests = [Request(request_id=i, group=i, prompt_ids=p, params=SamplingParams(max_new_tokens=n, **GREEDY),
                        seed=0) for i, (p, n) in enumerate(zip(ids, lengths))]
    engine.generate(requests)
    for r, p, n in zip(requests, ids, lengths):
        assert r.output_ids == hf_greedy(path, p, n, eos=None) and r.slot is None
    batches = [b for b, _ in engine.stats.decode_steps]
    assert max(batches) == 2 and 1 in batches
    assert engine.cache.num_free == 2
    assert len(engine.stats.decode_steps) == sum(lengths) - len(lengths) - batches.count(2)


def test_a_moved_request_recomputes_its_cache_and_continues(llama):
    """A request arriving with generated tokens (as adaptive TP hands them over) is prefilled with
    prompt + output[:-1] and continues exactly where it was."""
    path, model = llama
    prompt = prompts()[2]
    expected = hf_greedy(path, prompt, 10, eos=None)
    lp = hf_logprobs(path, prompt, expected)
    moved = Request(request_id=0, group=0, prompt_ids=prompt, params=SamplingParams(max_new_tokens=10, **GREEDY),
                    seed=0, output_ids=expected[:4], output_logprobs=lp[:4].tolist())
    fresh = Request(request_id=1, group=0, prompt_ids=prompt, params=SamplingParams(max_new_tokens=10, **GREEDY),
                    seed=0)
    GenerationEngine(model, EngineConfig(max_seq_len=64), eos_token_ids=()).generate([moved, fresh])
    for r in (moved, fresh):
        assert r.output_ids == expected
        torch.testing.assert_close(torch.tensor(r.output_logprobs), lp, atol=1e-4, rtol=0)


def test_evicted_requests_continue_in_another_engine(llama):
    """Mid-decode, requests leave one engine with their state and finish in another (the
    recompute path of adaptive TP): the tokens are those of an uninterrupted run."""
    path, model = llama
    ids = prompts()[:3]
    params = [SamplingParams(max_new_tokens=9, **GREEDY), SamplingParams(max_new_tokens=9, temperature=1.0, seed=4)]
    reference = make_requests(ids, params + params[:1], 2)
    GenerationEngine(model, EngineConfig(max_seq_len=64), eos_token_ids=()).generate(reference)

    first = GenerationEngine(model, EngineConfig(max_seq_len=64, max_batch_size=4), eos_token_ids=())
    requests = make_requests(ids, params + params[:1], 2)
    first.submit(requests)
    for _ in range(4):
        first.step()
    moved = first.evict()
    assert sorted(r.request_id for r in moved) == list(range(6)) and not first.busy
    assert first.cache.num_free == 4 and any(r.output_ids for r in moved) and any(not r.output_ids for r in moved)
    GenerationEngine(model, EngineConfig(max_seq_len=64), eos_token_ids=()).generate(moved)
    for r, ref in zip(requests, reference):
        assert r.output_ids == ref.output_ids and r.finish_reason == ref.finish_reason
        torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4,
                                   rtol=0)

    batch = to_sequence_batch(requests)
    r = requests[3]
    rows = slice(int(batch.offsets[3]), int(batch.offsets[4]))
    assert batch.token_fields["input_ids"][rows].tolist() == r.prompt_ids + r.output_ids
    assert batch.seq_fields["prompt_lengths"][3] == len(r.prompt_ids)
    assert batch.token_fields["loss_mask"][rows].sum() == len(r.output_ids)
    assert batch.token_fields["logprobs"][rows][len(r.prompt_ids):].tolist() == r.output_logprobs
    assert batch.meta["finish_reason"][3] == "length"


@pytest.mark.parametrize("samples", [(3, 3, 3), (3, 1, 2)])
def test_samples_of_a_prompt_share_its_prefill(llama, samples):
    """One prefill per prompt writes its keys and values into every sample's slot: greedy samples
    of different-length prompts, admitted together (with equal and with different sample counts),
    each continue as transformers does."""
    path, model = llama
    ps = prompts()[:3]
    engine = GenerationEngine(model, EngineConfig(max_seq_len=64), eos_token_ids=())
    requests = []
    for i, n in enumerate(samples):
        for r in make_requests([ps[i]], SamplingParams(max_new_tokens=6, **GREEDY), samples_per_prompt=n):
            r.request_id, r.group = len(requests), i
            requests.append(r)
    engine.generate(requests)
    assert engine.stats.prefill_tokens == sum(len(p) for p in ps)  # once per prompt
    for r in requests:
        assert r.output_ids == hf_greedy(path, ps[r.group], 6, eos=None), r.request_id


def test_steps_read_shared_prompts_only_when_rows_share_one(llama):
    """Decode steps pass prompt groups to the attention only while some row belongs to one (a step
    where none does is specialised without the prompt pass)."""
    _, model = llama
    engine = GenerationEngine(model, EngineConfig(max_seq_len=48, share_prompt_kv=True), eos_token_ids=())
    seen = []
    inner = engine.attention
    engine.attention = lambda *args: (seen.append(args[6] is not None), inner(*args))[1]
    engine.generate(make_requests(prompts()[:2], SamplingParams(max_new_tokens=3, **GREEDY)))
    assert seen and not any(seen)
    seen.clear()
    engine.generate(make_requests(prompts()[:2], SamplingParams(max_new_tokens=3, **GREEDY), samples_per_prompt=2))
    assert seen and all(seen)


def test_kv_cache_budget_and_slots():
    from shardflow.models.tiny import tiny_hf_config

    cfg = ModelConfig.from_hf_dict(tiny_hf_config("llama").to_dict())
    shard = shard_for(cfg, Layout((0, 1, 2, 3), tp=4), 1)  # tp=4 over 2 KV heads: one head per rank
    per_slot = bytes_per_slot(shard, cfg, 32, torch.float32)
    assert per_slot == 2 * 4 * 1 * 32 * 16 * 4
    cache = KVCache.for_model(cfg, shard, budget_bytes=5 * per_slot + 7, max_len=32, max_slots=100,
                              dtype=torch.float32, device="cpu")
    assert cache.num_slots == 4 and cache.k[0].shape == (5, 1, 32, 16)
    assert KVCache.for_model(cfg, shard, budget_bytes=10**9, max_len=32, max_slots=3, dtype=torch.float32,
                             device="cpu").num_slots == 3
    with pytest.raises(ValueError, match="holds no sequence"):
        KVCache.for_model(cfg, shard, budget_bytes=per_slot, max_len=32, max_slots=4, dtype=torch.float32,
                          device="cpu")
    assert cache.allocate(2) == [0, 1]
    cache.release(0)
    assert cache.allocate(3) == [0, 2, 3]


def test_refusals(llama, checkpoints):
    _, model = llama
    cfg = model.cfg
    stage = build_model(cfg, shard_for(cfg, Layout((0, 1), pp=2), 0), None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="pipeline parallelism is not supported"):
        GenerationEngine(stage)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        GenerationEngine(model, EngineConfig(max_seq_len=cfg.max_position_embeddings + 1))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GenerationEngine(model, EngineConfig(cuda_graphs=True))
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        make_requests([[3], []], SamplingParams())
    assert derive_seed(5, 1, 2) == derive_seed(5, 1, 2) != derive_seed(5, 2, 1)


def test_blas_library_is_checked_before_work_starts(checkpoints):
    with pytest.raises(ValueError, match="blas_library must be one of cublas, cublaslt or None; got 'mkl'"):
        EngineConfig(blas_library="mkl")
    model = local_model(checkpoints.get("llama", "llama"))
    with pytest.raises(ValueError, match="blas_library 'cublaslt' needs a CUDA device; the model is on cpu"):
        GenerationEngine(model, EngineConfig(max_seq_len=32, blas_library="cublaslt"))


def test_compiled_decode_layer_matches_transformers_and_compiles_once_for_all_layers(checkpoints):
    """``compile``: the decode step's layers run through one compiled function, traced once for
    every layer (not once per layer, nor the whole unrolled stack), and greedy decoding still
    gives transformers' tokens (Qwen3: q/k norms, tied head; a paged cache, shared prompt blocks)."""
    path = checkpoints.get("qwen3_qknorm", "qwen3", tie_word_embeddings=True)
    model = local_model(path)
    assert len(model.model.layers) > 1
    prompt = prompts()[2]
    expected = hf_greedy(path, prompt, 6, eos=None)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    config = EngineConfig(max_seq_len=48, max_batch_size=4, compile=True, kv_block_size=16)
    engine = GenerationEngine(model, config)
    requests = engine.generate(make_requests([prompt], SamplingParams(max_new_tokens=6, **GREEDY), 3))
    assert all(r.output_ids == expected for r in requests)
    # one batch size: one graph of one layer (the whole stack or a graph per layer would differ),
    # one of the step's start, one of its end, one of the sampler's pick; no breaks
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for fn in (decode_layer, decode_start, decode_end, pick):
        assert len(_debug_get_cache_entry_list(fn.__code__)) == 1, fn.__name__
    torch._dynamo.reset()
