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


def test_episodes_in_a_paged_cache_match_the_contiguous_one(checkpoints):
    """Parked episodes hold their blocks between turns, and give them up (their history is then
    recomputed at the next turn) when a cache of four 96-token sequences runs full."""
    path = checkpoints.get("episode_llama", "llama")
    model = local_model(path)
    params = SamplingParams(max_new_tokens=TURN_TOKENS, temperature=0.0)
    engine = GenerationEngine(model, EngineConfig(max_batch_size=8, max_seq_len=96), eos_token_ids=(2,))
    want = run_episodes(engine, make_requests(prompts(), params, 2), 128)
    per_block = 16 * engine.cache.k[0][0, :, 0].numel() * 4 * 2 * len(engine.cache.k)
    paged = GenerationEngine(model, EngineConfig(max_batch_size=8, max_seq_len=96, kv_block_size=16,
                                                 kv_cache_bytes=25 * per_block), eos_token_ids=(2,))
    got = run_episodes(paged, make_requests(prompts(), params, 2), 128)
    assert paged.cache.num_blocks == 24 and paged.stats.preemptions > 0
    assert paged.cache.num_free_blocks == paged.cache.num_blocks
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids and a.observation_spans == b.observation_spans
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0)


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


class ScriptedTurns:
    """The holder's side of ``run_episodes`` with a scripted environment: each ended turn gets
    ``observation`` (until ``TURNS`` turns, or the context, are reached) once ``ready`` has been
    asked ``delay`` times since, or at once when the caller waits (nothing else to decode)."""

    def __init__(self, vocab: int, max_seq_len: int, delay: int = 0):
        self.vocab, self.max_seq_len, self.delay, self.answers = vocab, max_seq_len, delay, []

    def begin(self, request, row):
        pass

    def ended(self, r):
        more = r.turns < TURNS and r.num_tokens + 8 < self.max_seq_len
        self.answers.append([self.delay, (r.request_id, observation(r, self.vocab) if more else None)])

    def ready(self, wait):
        for a in self.answers:
            a[0] -= 1
        out = [answer for left, answer in self.answers if wait or left < 0]
        self.answers = [a for a in self.answers if not (wait or a[0] < 0)]
        return out


class LateTurns(ScriptedTurns):
    """ScriptedTurns whose answers each come after a random number of looks, in random order: an
    environment whose speed varies from run to run."""

    def __init__(self, vocab: int, max_seq_len: int, seed: int):
        super().__init__(vocab, max_seq_len)
        self.gen = torch.Generator().manual_seed(seed)

    def ended(self, r):
        super().ended(r)
        self.answers[-1][0] = int(torch.randint(0, 4, (1,), generator=self.gen))

    def ready(self, wait):
        out = super().ready(wait and not any(left < 1 for left, _ in self.answers))
        return [out[i] for i in torch.randperm(len(out), generator=self.gen).tolist()]


def steps_of_episodes(engine, seed: int, reproducible: bool) -> tuple[int, list]:
    from shardflow.engine.generate.episodes import run_episodes

    requests = make_requests(prompts(), SamplingParams(max_new_tokens=TURN_TOKENS, temperature=1.0), 2)
    steps = run_episodes(engine, requests, LateTurns(128, 96, seed), [{}] * len(requests),
                         share=lambda answers: answers, max_output=200, sync_every=2, reproducible=reproducible)
    return steps, [(r.output_ids, r.observation_spans) for r in requests]


def test_reproducible_episodes_resume_at_steps_the_tokens_fix(checkpoints):
    """However late and in whatever order the environments answer, reproducible episodes take the
    same decode steps to the same tokens; without it, the steps follow the environments' speed."""
    engine = GenerationEngine(local_model(checkpoints.get("episode_llama", "llama")),
                              EngineConfig(max_batch_size=4, max_seq_len=96), eos_token_ids=(2,))
    runs = [steps_of_episodes(engine, seed, reproducible=True) for seed in range(3)]
    assert all(run == runs[0] for run in runs)
    assert len({steps_of_episodes(engine, seed, reproducible=False)[0] for seed in range(3)}) > 1


def adaptive_episodes_job(world, path: str, start: str, target: str, schedule: dict):
    from shardflow.config.experiment import AdaptiveConfig
    from shardflow.engine.adaptive.generator import AdaptiveGenerator
    from shardflow.engine.generate.episodes import Episodes
    from shardflow.engine.generate.replicas import replica_share

    start_l, target_l = Layout.parse(start), Layout.parse(target)
    world.create_groups([start_l, target_l])
    if world.rank not in start_l:
        return None
    model, _ = load_model(path, start_l, world)
    config = EngineConfig(max_batch_size=8, max_seq_len=96)  # room to migrate the other replica's KV
    # turns of 4 and 10 tokens: the short ones wait for their environment while the long ones decode
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (4, 10, 4, 10)]
    holder = start_l.coord(world.rank).tp == 0
    out = {}
    # the plain engine: each replica's share as episodes (tp = 1 here: nothing to broadcast)
    requests = make_requests(prompts(), params, 2)
    mine = replica_share(requests, start_l.dp, start_l.coord(world.rank).dp)
    engine = GenerationEngine(model, config, eos_token_ids=(2,))
    run_episodes_engine(engine, mine, ScriptedTurns(128, 96, delay=1))
    out["static"] = {r.request_id: (r.output_ids, r.output_logprobs, r.observation_spans) for r in mine}
    generator = AdaptiveGenerator(world, model, [target_l], engine_config=config, eos_token_ids=(2,),
                                  config=AdaptiveConfig(interval=2))
    for mode in ("migrate", "recompute"):
        requests = make_requests(prompts(), params, 2)
        over = []
        # answers come three decision points (6 steps) after a turn ends: the switch finds
        # episodes between turns, which travel without their KV
        episodes = Episodes(ScriptedTurns(128, 96, delay=3) if holder else None, {r.request_id: {} for r in requests},
                            200)
        done = generator.generate(requests, over.append, schedule={s: (target_l, mode) for s in schedule[mode]},
                                  episodes=episodes)
        out[f"over_{mode}"] = sorted(r.request_id for r in over)
        if done is not None:
            out[mode] = {r.request_id: (r.output_ids, r.output_logprobs, r.observation_spans) for r in done}
            out[f"switches_{mode}"] = [s.between_turns for s in generator.last_trace.switches]
    return out


def run_episodes_engine(engine, requests, turns):
    from shardflow.engine.generate.episodes import run_episodes

    run_episodes(engine, requests, turns, [{}] * len(requests), share=lambda answers: answers, max_output=200)


def test_episodes_switch_layout_mid_decode_and_keep_their_tokens(pool, checkpoints):
    """d2 x tp1 -> d1 x tp2 while episodes are between turns and decoding (KV migrated or
    recomputed): every episode's tokens are the static engine's, and each ends once."""
    path = checkpoints.get("episode_llama", "llama")
    schedule = {"migrate": [8], "recompute": [10]}
    results = [r for r in pool.run(adaptive_episodes_job, path, "d2p1t1@0-1", "d1p1t2@0-1", schedule) if r]
    static = {k: v for r in results for k, v in r["static"].items()}
    first = next(r for r in results if "migrate" in r)
    assert first["switches_migrate"] == [4]  # the short turns' episodes wait for their environment
    assert len(first["switches_recompute"]) == 1
    for mode in ("migrate", "recompute"):
        assert sorted(first[mode]) == sorted(static)
        for request_id, (tokens, logprobs, spans) in first[mode].items():
            ref_tokens, ref_logprobs, ref_spans = static[request_id]
            assert tokens == ref_tokens and spans == ref_spans, (mode, request_id)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=LOGPROB_ATOL, rtol=0)
        assert max(len(spans) for _, _, spans in first[mode].values()) == TURNS - 1
        # each rank's on_finish saw its own starting share's episodes, each once
        assert sorted(x for r in results for x in r[f"over_{mode}"]) == sorted(static)
