"""Multi-turn episodes in the generation engine: a turn's KV stays in its slot, the observation is
prefilled onto it, and the log-probabilities equal transformers' over the whole history prefilled
afresh, under (dp, tp) layouts and with the Mistral sliding window."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import hf_model, local_model, prompts

from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.replicas import generate_replicated
from shardflow.engine.generate.requests import SamplingParams, make_requests, to_sequence_batch
from shardflow.models.checkpoint import load_model
from shardflow.parallel.layout import Layout
from shardflow.rl.losses import ActorLoss

TURNS, TURN_TOKENS = 3, 6
LOGPROB_ATOL = 1e-4


def observation(r, vocab: int) -> list[int]:
    """A deterministic observation per request and turn, 3 to 7 tokens."""
    g = torch.Generator().manual_seed(1000 * r.request_id + r.turns)
    return torch.randint(3, vocab, (3 + r.turns + r.request_id % 2,), generator=g).tolist()


def run_episodes(engine: GenerationEngine, requests, vocab: int, *, keep_kv: bool = True):
    """Every request an episode of ``TURNS`` turns; returns the finished requests."""
    for r in requests:
        r.keep_kv, r.max_output = keep_kv, 200
    ended = []
    engine.submit(requests)
    while engine.busy:
        engine.step(ended.append)
        for r in ended:
            if r.turns < TURNS and r.num_tokens + 8 < engine.max_seq_len:
                r.continue_with(observation(r, vocab))
                engine.submit([r])
            elif keep_kv:
                engine.close([r])
        ended.clear()
    assert not engine.parked and engine.cache.num_free == engine.cache.num_slots
    return requests


def hf_check(path: str, requests) -> None:
    """Each model token: transformers' log-probability given the whole history, and its argmax
    (greedy); observation tokens are out of the loss mask."""
    model = hf_model(path)
    batch = to_sequence_batch(requests)
    for i, r in enumerate(requests):
        full = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(r.prompt_ids) - 1: -1]
        logp = torch.log_softmax(logits, -1)
        mine = torch.tensor(r.model_mask()) > 0
        assert mine.sum() < len(r.output_ids), "no observation in the episode: nothing was tested"
        tokens = torch.tensor(r.output_ids)
        assert torch.equal(logp.argmax(-1)[mine], tokens[mine])
        expected = logp.gather(-1, tokens[:, None])[:, 0][mine]
        torch.testing.assert_close(torch.tensor(r.output_logprobs)[mine], expected, atol=LOGPROB_ATOL, rtol=0)
        assert all(x == 0.0 for x, m in zip(r.output_logprobs, mine) if not m)
        start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
        assert batch.token_fields["loss_mask"][start:end].tolist() == [0.0] * len(r.prompt_ids) + r.model_mask()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_continued_episodes_match_the_history_prefilled_afresh(checkpoints, family):
    path = checkpoints.get(f"episode_{family}", family)
    engine = GenerationEngine(local_model(path), EngineConfig(max_batch_size=4, max_seq_len=96),
                              eos_token_ids=(2,))
    params = SamplingParams(max_new_tokens=TURN_TOKENS, temperature=0.0)
    # two samples per prompt: they share a prefill and its shared-prompt attention groups
    done = run_episodes(engine, make_requests(prompts(), params, 2), 128)
    assert max(r.turns for r in done) == TURNS
    hf_check(path, done)
    # the same episodes with the KV dropped between turns (the history recomputed) agree exactly
    again = run_episodes(engine, make_requests(prompts(), params, 2), 128, keep_kv=False)
    for a, b in zip(done, again):
        assert a.output_ids == b.output_ids and a.observation_spans == b.observation_spans
    assert engine.stats.prefill_tokens > 0


def episodes_job(world, path: str, layout_text: str, prompt_ids: list[list[int]]):
    layout = Layout.parse(layout_text)
    world.create_groups([layout])
    if world.rank not in layout:
        return None
    model, _ = load_model(path, layout, world)
    engine = GenerationEngine(model, EngineConfig(max_batch_size=3, max_seq_len=96), eos_token_ids=(2,))
    requests = make_requests(prompt_ids, SamplingParams(max_new_tokens=TURN_TOKENS, temperature=0.0), 1)

    class Episodes:  # the engine behind generate_replicated, each replica's share run as episodes
        def generate(self, mine, on_finish=None):
            return run_episodes(engine, list(mine), 128)

    done = generate_replicated(Episodes(), layout, world, requests)
    return None if done is None else [(r.output_ids, r.output_logprobs, r.observation_spans) for r in done]


@pytest.mark.parametrize("layout", ["d1p1t2@0-1", "d2p1t2@0-3"])
def test_episodes_under_tensor_and_data_parallel_layouts(pool, checkpoints, layout):
    path = checkpoints.get("episode_llama", "llama")
    ids = prompts()
    results = [r for r in pool.run(episodes_job, path, layout, ids) if r is not None]
    assert len(results) == 1
    requests = make_requests(ids, SamplingParams(max_new_tokens=TURN_TOKENS, temperature=0.0), 1)
    for r, (output, logprobs, spans) in zip(requests, results[0]):
        r.output_ids, r.output_logprobs, r.observation_spans, r.finish_reason = output, logprobs, spans, "stop"
    hf_check(path, requests)


def test_observation_tokens_get_no_gradient(checkpoints):
    """An episode's rollout trains on the model's tokens only: the loss's gradient by each
    observation token's log-probability is exactly zero, by every token of a turn it is not."""
    path = checkpoints.get("episode_llama", "llama")
    engine = GenerationEngine(local_model(path), EngineConfig(max_batch_size=4, max_seq_len=96), eos_token_ids=(2,))
    done = run_episodes(engine, make_requests(prompts()[:2], SamplingParams(max_new_tokens=TURN_TOKENS), 2), 128)
    batch = to_sequence_batch(done)
    batch = batch.update({"advantages": torch.ones(batch.num_tokens)})
    new = (batch.token_fields["logprobs"] - 0.01).requires_grad_()
    loss_fn = ActorLoss(clip_low=0.2)
    loss, _ = loss_fn({"logprobs": new}, batch, loss_fn.normalizer(batch))
    loss.backward()
    observed = torch.cat([torch.tensor([0.0] * len(r.prompt_ids) + [1.0 - m for m in r.model_mask()]) for r in done])
    assert observed.sum() > 0
    assert (new.grad[observed > 0] == 0).all()
    assert (new.grad[batch.token_fields["loss_mask"] > 0] != 0).all()
