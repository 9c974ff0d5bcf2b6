"""Token sampling: greedy, temperature, top-k, top-p, vocabulary-parallel and reproducible.

Sampling uses the Gumbel-max trick: ``argmax(logits / T + g)`` with ``g`` standard Gumbel noise
draws a token from ``softmax(logits / T)`` without a multinomial (no host synchronisation).
The noise is a pure function of (request seed, token position, global vocabulary index), computed
with a counter-based integer hash in torch, so a token depends only on the seed and the logits:
not on the tp layout, the batch it was decoded in, or whether a CUDA graph replayed it.

Under tp each rank holds a slice of the vocabulary. Without top-k/top-p every rank finds its best
(score, index) per chunk of its slice (one chunk in torch; on GPUs a Triton kernel, see
``sampling_kernel``, reads the logits once for C chunks) and the tiny candidates are all-gathered
(one all-gather of [tp * C, B, 5] per step);
with top-k/top-p in the batch the logits are all-gathered (one all-gather of [B, V]) and every rank
samples the same token from the full vocabulary.

Log-probabilities returned are those of ``softmax(logits / T)`` before top-k/top-p truncation
(the usual RL convention: the trainer recomputes them from the same logits and temperature);
for greedy rows (T = 0) they are those of ``softmax(logits)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed import ProcessGroup

from shardflow.engine.generate import sampling_kernel
from shardflow.parallel import comm

MASK32 = 0xFFFFFFFF

# Which sampling computation a batch needs; decided on the host from the requests' parameters so
# that a CUDA graph can be captured per mode. A row's token is the same in every mode it fits.
GREEDY, SAMPLE, FILTER = "greedy", "sample", "filter"


@dataclass(kw_only=True)
class SamplingTensors:
    """Per-row sampling parameters, on the logits' device; one row per batch row."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    seed: torch.Tensor  # [B] int64, in [0, 2**62)
    position: torch.Tensor  # [B] int64, sequence position of the token being drawn


def batch_mode(temperatures: Sequence[float], top_ks: Sequence[int], top_ps: Sequence[float]) -> str:
    """The cheapest sampling computation that serves every row of a batch."""
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        return FILTER
    return SAMPLE if any(t > 0 for t in temperatures) else GREEDY


# ----- counter-based noise ------------------------------------------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), exactly, in int64 without overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer (bijective on [0, 2**32); "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit key per (seed, position): a chain of bijective mixes, so that for one seed
    every position gets a distinct key."""
    k = _mix32((seed >> 32) & MASK32)
    k = _mix32(k ^ (seed & MASK32))
    return _mix32(k ^ (position & MASK32))


def noise_bits(seed: torch.Tensor, position: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """[B, V] 32-bit hashes (int64 in [0, 2**32)) of (seed[b], position[b], vocab_ids[v])."""
    key = row_keys(seed, position)  # [B]
    # (id + 0x9E3779B9) mod 2**32, written with a constant that fits int32: the compiler folds it
    # into the kernel's int32 index arithmetic, where 0x9E3779B9 itself does not compile.
    v = _mix32((vocab_ids.to(torch.int64) - 0x61C88647) & MASK32)  # [V]
    h = _mix32(key[:, None] ^ v[None, :])
    return _mix32(h ^ (key[:, None] >> 7))  # second round: rows with nearby keys decorrelate fully


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed[b], position[b], vocab_ids[v])."""
    return unit_interval(noise_bits(seed, position, vocab_ids))


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit integers -> float32 in (0, 1): the 23 high bits, centred in their bucket. n + 0.5
    needs 24 bits, exactly what float32 holds, so no value rounds to 0 or 1 (with 24 bits,
    n = 2**24 - 1 would round to 1, and its Gumbel noise would be infinite)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """[B, V] standard Gumbel noise (see ``uniform_noise``)."""
    return -torch.log(-torch.log(uniform_noise(seed, position, vocab_ids)))


# ----- truncation ---------------------------------------------------------------------------------

def truncation_mask(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] True where a token survives top-k, then top-p over the renormalised rest.

    As in ``transformers``: top-k keeps every token whose scaled logit is at least the k-th
    largest; top-p keeps the smallest prefix of the descending order whose mass reaches p (the
    token that crosses p is kept, and so is the most likely token).
    """
    V = z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sorted_z.gather(-1, (k - 1)[:, None])  # [B, 1]
    keep_sorted = sorted_z >= kth
    probs = torch.softmax(sorted_z.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # exclusive cumulative mass
    keep_sorted &= mass_before < top_p[:, None]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


# ----- the sampler -------------------------------------------------------------------------------

def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 logits / T (T = 1 for greedy rows): the distribution log-probabilities refer to."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits.float() / t[:, None]


def local_candidates(z: torch.Tensor, st: SamplingTensors, vocab_start: int, mode: str) -> torch.Tensor:
    """[B, 5] float64 summary of one rank's vocabulary slice ``z`` [B, V_local] (scaled logits):
    best score, its global index, its scaled logit, the slice's max and sum of exp(z - max)."""
    vocab_ids = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
    score = z
    if mode != GREEDY:
        noise = gumbel_noise(st.seed, st.position, vocab_ids)
        score = z + noise * (st.temperature > 0).to(z.dtype)[:, None]
    best_score, best = score.max(dim=-1)  # first maximum: the lowest index among ties
    z_best = z.gather(-1, best[:, None]).squeeze(-1)
    m = z.max(dim=-1).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a slice of vocabulary padding only
    s = torch.exp(z - m_safe[:, None]).sum(-1)
    return torch.stack([best_score.double(), (best + vocab_start).double(), z_best.double(),
                        m.double(), s.double()], dim=-1)


def pick(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token [B] and log-probability [B] from the candidates [R, B, 5] of R vocabulary slices
    (in vocabulary order); ties go to the first slice, i.e. the lowest vocabulary index."""
    best_score, index, z_best, m, s = candidates.unbind(-1)  # each [R, B]
    winner = best_score.argmax(dim=0)  # [B]
    token = index.gather(0, winner[None]).squeeze(0).long()
    z_token = z_best.gather(0, winner[None]).squeeze(0)
    top = m.max(dim=0).values  # [B]
    lse = top + torch.log((s * torch.exp(m - top[None])).sum(0))
    return token, (z_token - lse).float()


def sample(logits: torch.Tensor, st: SamplingTensors, *, vocab_start: int, vocab_size: int,
           group: ProcessGroup | None, mode: str, pick_fn=pick) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from this rank's logits [B, V_local] (padding columns at -inf).

    Returns (tokens [B] int64, log-probabilities [B] float32), identical on every tp rank.
    Collectives: GREEDY/SAMPLE one all-gather of [C, B, 5] candidates (C vocabulary chunks per
    rank: 1 in torch, the Triton kernel's on GPUs; gathered in rank order, so the chunks stay in
    vocabulary order); FILTER one of the logits. ``pick_fn``: ``pick`` or a compiled version of it.
    """
    if mode != FILTER and logits.is_cuda and sampling_kernel.triton is not None:  # one pass over the logits
        mine = sampling_kernel.sample_candidates_op(logits, st.temperature, st.seed, st.position, vocab_start,
                                                    mode == SAMPLE)
        return pick_fn(comm.all_gather(mine, group, dim=0))
    z = scaled_logits(logits, st.temperature)  # [B, V_local]
    if mode != FILTER:
        mine = local_candidates(z, st, vocab_start, mode)[None]  # [1, B, 5]
        return pick_fn(comm.all_gather(mine, group, dim=0))
    z = comm.all_gather(z, group, dim=-1)[:, :vocab_size]  # [B, V]: the full vocabulary
    lse = torch.logsumexp(z, dim=-1)
    keep = truncation_mask(z, st.top_k, st.top_p)
    noise = gumbel_noise(st.seed, st.position, torch.arange(vocab_size, device=z.device))
    score = z + noise * (st.temperature > 0).to(z.dtype)[:, None]
    token = score.masked_fill(~keep, float("-inf")).argmax(dim=-1)
    return token, (z.gather(-1, token[:, None]).squeeze(-1) - lse).float()
