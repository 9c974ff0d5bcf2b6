"""Sampling: right in distribution, truncation excludes what it must, vocab-parallel equals full,
seeds reproduce; and the engine samples from the softmax the model defines."""

from __future__ import annotations

import torch
from gen_helpers import hf_model, local_model

from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.requests import SamplingParams, make_requests
from shardflow.engine.generate.sampling import (
    FILTER,
    GREEDY,
    SAMPLE,
    SamplingTensors,
    local_candidates,
    pick,
    sample,
    scaled_logits,
    truncation_mask,
    uniform_noise,
    unit_interval,
)

P_MIN = 1e-3  # every distribution test below is deterministic (fixed seeds); a wrong sampler fails it


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` (cells with probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0
    counts, probs = counts[probs > 0].double(), probs[probs > 0].double()
    expected = probs / probs.sum() * counts.sum()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(counts) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def tensors(n: int, *, temperature=1.0, top_k=0, top_p=1.0, seed0=0, position=5) -> SamplingTensors:
    return SamplingTensors(temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k),
                           top_p=torch.full((n,), top_p), seed=torch.arange(seed0, seed0 + n),
                           position=torch.full((n,), position))


LOGITS = torch.tensor([1.5, 0.2, -0.7, 2.1, 0.0, -1.6, 0.9, 0.4])
N = 40_000


def draw(logits: torch.Tensor, st: SamplingTensors, mode: str):
    rows = logits.expand(len(st.seed), -1)
    return sample(rows, st, vocab_start=0, vocab_size=logits.shape[-1], group=None, mode=mode)


def test_noise_is_uniform_reproducible_and_decorrelated():
    seeds, positions = torch.arange(2000), torch.full((2000,), 17)
    u = uniform_noise(seeds, positions, torch.arange(64))  # [2000, 64]
    assert torch.equal(u, uniform_noise(seeds, positions, torch.arange(64)))
    assert 0 < u.min() and u.max() < 1


def test_noise_stays_inside_the_open_interval_at_its_extremes():
    """The hash's largest outputs must not round to 1 in float32 (the Gumbel noise would be infinite)."""
    u = unit_interval(torch.tensor([0, 1, 511, 512, 2**32 - 513, 2**32 - 2, 2**32 - 1]))
    assert 0 < u.min() and u.max() < 1
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_temperature_sampling_follows_the_softmax():
    for temperature in (1.0, 0.6):
        tokens, logprobs = draw(LOGITS, tensors(N, temperature=temperature), SAMPLE)
        probs = torch.softmax(LOGITS / temperature, -1)
        assert chi_square_p(torch.bincount(tokens, minlength=8), probs) > P_MIN, temperature
        torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_greedy_takes_the_argmax_and_reports_the_untempered_logprob():
    tokens, logprobs = draw(LOGITS, tensors(5, temperature=0.0), GREEDY)
    assert tokens.tolist() == [3] * 5
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[tokens])


def nucleus_size(sorted_probs: torch.Tensor, p: float) -> int:
    """Tokens kept by top-p: those before the mass reaches p, and the one that crosses it."""
    return int((sorted_probs.cumsum(0) < p).sum()) + 1


def test_top_k_and_top_p_exclude_what_they_must_and_renormalise_the_rest():
    probs = torch.softmax(LOGITS, -1)
    order = probs.argsort(descending=True).tolist()
    top4 = probs[order[:4]] / probs[order[:4]].sum()
    cases = {  # (top_k, top_p) -> the tokens that may appear, derived by hand
        (3, 1.0): order[:3],
        (0, 0.8): order[: nucleus_size(probs[order], 0.8)],
        (4, 0.5): order[: nucleus_size(top4, 0.5)],  # top-p over the renormalised top-4
    }
    assert [len(a) for a in cases.values()] == [3, 4, 2]  # the cases exercise what they claim
    for (k, p), allowed in cases.items():
        tokens, logprobs = draw(LOGITS, tensors(N, top_k=k, top_p=p), FILTER)
        kept = torch.zeros(8, dtype=torch.bool)
        kept[allowed] = True
        assert torch.equal(truncation_mask(LOGITS[None], torch.tensor([k]), torch.tensor([p]))[0], kept), (k, p)
        counts = torch.bincount(tokens, minlength=8)
        assert counts[~kept].sum() == 0, (k, p)
        assert chi_square_p(counts, torch.where(kept, probs, 0.0)) > P_MIN, (k, p)
        # Log-probabilities are those of the untruncated distribution (documented convention).
        torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_a_rows_token_does_not_depend_on_the_batch_mode():
    n = 500
    st = tensors(n, temperature=0.9)
    sampled, _ = draw(LOGITS, st, SAMPLE)
    filtered, _ = draw(LOGITS, st, FILTER)  # no row truncates: the same draws
    assert torch.equal(sampled, filtered)
    st.temperature[::2] = 0.0  # greedy rows inside a sampling batch
    mixed, _ = draw(LOGITS, st, SAMPLE)
    assert (mixed[::2] == 3).all() and torch.equal(mixed[1::2], sampled[1::2])


def test_vocab_parallel_candidates_equal_the_full_vocabulary():
    g = torch.Generator().manual_seed(0)
    vocab = 130
    logits = torch.randn(64, vocab, generator=g) * 3
    st = tensors(64, temperature=0.8)
    st.temperature[:8] = 0.0
    full_tokens, full_lp = pick(local_candidates(scaled_logits(logits, st.temperature), st, 0, SAMPLE)[None])
    for tp in (2, 3, 4):
        local = -(-vocab // tp)
        padded = torch.full((64, local * tp), float("-inf"))
        padded[:, :vocab] = logits
        pieces = [local_candidates(scaled_logits(padded[:, r * local:(r + 1) * local], st.temperature), st,
                                   r * local, SAMPLE) for r in range(tp)]
        tokens, lp = pick(torch.stack(pieces))
        assert torch.equal(tokens, full_tokens), tp
        torch.testing.assert_close(lp, full_lp)
    expected = torch.log_softmax(scaled_logits(logits, st.temperature), -1).gather(-1, full_tokens[:, None])[:, 0]
    torch.testing.assert_close(full_lp, expected)


def test_engine_samples_from_the_models_softmax(checkpoints):
    """Many samples of one prompt from a tiny-vocabulary model: the first token follows
    softmax(logits / T) of transformers, and so does the second given the first."""
    path = checkpoints.get("vocab8", "llama", vocab_size=8, with_tokenizer=False)
    prompt, temperature, n = [3, 4, 5, 6, 7, 3], 0.9, 3000
    engine = GenerationEngine(local_model(path), EngineConfig(max_seq_len=16))
    params = SamplingParams(max_new_tokens=2, temperature=temperature, seed=11, ignore_eos=True)
    requests = engine.generate(make_requests([prompt], params, n))
    first = torch.tensor([r.output_ids[0] for r in requests])
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / temperature, -1)
    assert chi_square_p(torch.bincount(first, minlength=8), probs) > P_MIN
    torch.testing.assert_close(torch.tensor([r.output_logprobs[0] for r in requests]), probs.log()[first],
                               atol=1e-5, rtol=0)
    common = int(torch.bincount(first).argmax())
    second = torch.tensor([r.output_ids[1] for r in requests if r.output_ids[0] == common])
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt + [common]])).logits[0, -1]
    assert chi_square_p(torch.bincount(second, minlength=8), torch.softmax(logits / temperature, -1)) > P_MIN
    # Same seeds, same tokens.
    again = engine.generate(make_requests([prompt], params, 50))
    assert [r.output_ids for r in again] == [r.output_ids for r in requests[:50]]


def _python_mix32(x: int) -> int:
    """The "lowbias32" mixer on Python integers: the reference the tensor hash must equal."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_equals_the_integer_hash_it_is_defined_by():
    seeds = [0, 1, 12345, 2**40 + 7, 2**62 - 1]
    positions = [0, 3, 999, 2**31 + 5, 70_000]
    vocab = [0, 1, 151_935, 2**31 - 1, 2**32 - 1]
    u = uniform_noise(torch.tensor(seeds), torch.tensor(positions), torch.tensor(vocab))
    for b, (seed, position) in enumerate(zip(seeds, positions)):
        key = _python_mix32((seed >> 32) & 0xFFFFFFFF)
        key = _python_mix32(key ^ (seed & 0xFFFFFFFF))
        key = _python_mix32(key ^ (position & 0xFFFFFFFF))
        for j, v in enumerate(vocab):
            h = _python_mix32(key ^ _python_mix32((v + 0x9E3779B9) & 0xFFFFFFFF))
            h = _python_mix32(h ^ (key >> 7))
            assert float(u[b, j]) == ((h >> 9) + 0.5) / 2**23, (seed, position, v)
