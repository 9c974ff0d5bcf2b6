"""Generation requests: explicit per-request state that can move between engines.

A request is everything needed to continue it anywhere: its prompt and generated tokens with
their log-probabilities, its sampling parameters and seed, and where its KV cache lives (a slot
of one engine's cache, holding ``cached_len`` positions). Adaptive TP moves requests between
replicas by handing this state over and either migrating the slot's KV or recomputing it with a
prefill of ``prompt_ids + output_ids[:-1]``.

A multi-turn episode is one request over several turns: when a turn ends, ``continue_with``
appends the observation's tokens to ``output_ids`` (spans in ``observation_spans``, log-probability
0, out of the loss) and the next turn decodes after them; ``max_new_tokens`` bounds each turn,
``max_output`` the whole episode.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from shardflow.data.batch import SequenceBatch

# Why a request ended.
STOP = "stop"  # produced an EOS or stop token (included in the output)
LENGTH = "length"  # produced max_new_tokens tokens
CONTEXT = "context"  # prompt + output reached the context limit (max_seq_len)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 256  # most tokens to generate
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with this much probability; 1 = off
    seed: int = 0  # base seed; each request derives its own from it (see ``make_requests``)
    stop_token_ids: tuple[int, ...] = ()  # stop on these, in addition to the model's EOS ids
    ignore_eos: bool = False  # do not stop on EOS (forced output length, for benchmarks)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(kw_only=True, eq=False)
class Request:
    request_id: int  # position in the caller's list; outputs are reported in this order
    group: int  # prompt index: the samples of one prompt share its prefill
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # this request's own seed, in [0, 2**62)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # log p(output_ids[i] | prefix)
    finish_reason: str | None = None  # STOP, LENGTH or CONTEXT once done
    slot: int | None = None  # KV cache slot while admitted to an engine
    cached_len: int = 0  # positions of the sequence whose K/V are in the slot
    # The slot's first ``shared_prompt`` positions are the same copy of the prompt that every
    # request of ``prompt_group`` holds (samples prefilled together); -1 and 0: none. Decode
    # attention may then read the prompt from one of them (``EngineConfig.share_prompt_kv``).
    prompt_group: int = -1
    shared_prompt: int = 0
    # Multi-turn episodes: [start, end) of each observation in output_ids; where the current turn's
    # tokens begin; the episode's cap on output tokens (None: max_new_tokens); and whether the
    # engine keeps the slot's KV when a turn ends (``GenerationEngine.close`` frees it).
    observation_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_start: int = 0
    max_output: int | None = None
    keep_kv: bool = False

    def drop_kv(self) -> None:
        """The request no longer holds KV anywhere (its slot was freed or is being recomputed)."""
        self.slot, self.cached_len = None, 0
        self.prompt_group, self.shared_prompt = -1, 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def ends_by_length(self, max_seq_len: int, *, pending: int = 0) -> bool:
        """Whether the request is at a length limit once ``pending`` more tokens are appended
        (the rule ``append`` applies, known before the tokens are)."""
        return self._at_length_limit(pending) or self.num_tokens + pending >= max_seq_len

    def _at_length_limit(self, pending: int = 0) -> bool:
        output = len(self.output_ids) + pending
        return (output - self.turn_start >= self.params.max_new_tokens
                or (self.max_output is not None and output >= self.max_output))

    def append(self, token: int, logprob: float, *, stop_ids: frozenset[int], max_seq_len: int) -> None:
        """Record a generated token and decide whether the request (or its turn) ends with it."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if token in stop_ids:
            self.finish_reason = STOP
        elif self.ends_by_length(max_seq_len):
            self.finish_reason = LENGTH if self._at_length_limit() else CONTEXT

    def continue_with(self, observation_ids: Sequence[int]) -> None:
        """Start the next turn of an episode whose turn ended: the observation's tokens join the
        output (out of the loss), and decoding goes on after them. The slot's KV, if kept, stays
        valid: only the tokens after ``cached_len`` are prefilled."""
        if not self.done:
            raise ValueError(f"request {self.request_id} is still generating its turn")
        if len(observation_ids) == 0:
            raise ValueError(f"request {self.request_id}: an observation must have at least one token")
        start = len(self.output_ids)
        self.output_ids.extend(int(t) for t in observation_ids)
        self.output_logprobs.extend([0.0] * len(observation_ids))
        self.observation_spans.append((start, len(self.output_ids)))
        self.turn_start, self.finish_reason = len(self.output_ids), None

    @property
    def turns(self) -> int:
        """The model's turns so far (the current one included)."""
        return len(self.observation_spans) + 1

    @property
    def model_tokens(self) -> int:
        """Output tokens the model generated (observations excluded)."""
        return len(self.output_ids) - sum(end - start for start, end in self.observation_spans)

    def model_mask(self) -> list[float]:
        """[len(output_ids)] 1.0 on the model's tokens, 0.0 on observations'."""
        mask = [1.0] * len(self.output_ids)
        for start, end in self.observation_spans:
            mask[start:end] = [0.0] * (end - start)
        return mask


def derive_seed(base: int, *keys: int) -> int:
    """A 62-bit seed from a base seed and integer keys (stable across runs and machines)."""
    text = ",".join(str(int(k)) for k in (base, *keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def make_requests(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                  samples_per_prompt: int = 1) -> list[Request]:
    """``samples_per_prompt`` requests per prompt, consecutive, numbered in that order.

    Sample j of prompt i gets seed ``derive_seed(params.seed, i, j)``: samples of one prompt differ,
    and a rerun with the same base seed reproduces every one of them.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    requests = []
    for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        for j in range(samples_per_prompt):
            requests.append(Request(request_id=len(requests), group=i, prompt_ids=[int(t) for t in ids],
                                    params=p, seed=derive_seed(p.seed, i, j)))
    return requests


def to_sequence_batch(requests: Sequence[Request]) -> SequenceBatch:
    """Finished requests as the RL batch: whole sequences (prompt + completion) in
    ``input_ids``, ``loss_mask`` 1.0 on completion tokens the model generated (not on an
    episode's observations), and ``logprobs`` aligned to the token
    they are about (``logprobs[t] = log p(ids[t] | ids[:t])``, 0 on prompt tokens);
    ``prompt_lengths`` per sequence, ``finish_reason`` in meta; sample ids are the request ids."""
    if any(not r.done for r in requests):
        raise ValueError("only finished requests make a batch")
    # One tensor per field from flat lists (hundreds of sequences of hundreds of tokens per call).
    prompt = torch.tensor([len(r.prompt_ids) for r in requests], dtype=torch.long)
    output = torch.tensor([len(r.output_ids) for r in requests], dtype=torch.long)
    ids = torch.tensor([t for r in requests for t in (*r.prompt_ids, *r.output_ids)], dtype=torch.long)
    logprobs = torch.tensor([x for r in requests for x in (*[0.0] * len(r.prompt_ids), *r.output_logprobs)],
                            dtype=torch.float32)
    parts = torch.stack([prompt, output], 1).reshape(-1)  # prompt, completion, prompt, ...
    mask = torch.tensor([0.0, 1.0]).repeat(len(requests)).repeat_interleave(parts)
    if any(r.observation_spans for r in requests):  # episodes: observations are not the model's to learn
        mask = torch.tensor([x for r in requests for x in (*[0.0] * len(r.prompt_ids), *r.model_mask())])
    return SequenceBatch(torch.tensor([r.request_id for r in requests], dtype=torch.long), prompt + output,
                         {"input_ids": ids, "loss_mask": mask, "logprobs": logprobs},
                         {"prompt_lengths": prompt}, {"finish_reason": [r.finish_reason for r in requests]})
