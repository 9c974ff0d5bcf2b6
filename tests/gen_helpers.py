"""Shared pieces of the generation tests: a one-rank model, prompts, and transformers references."""

from __future__ import annotations

import functools

import torch
import transformers

from shardflow.models.checkpoint import load_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World

PROMPT_LENGTHS = (5, 11, 23, 30)  # longer than the Mistral window of 16 once generation runs


def prompts(vocab: int = 128, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def local_model(path: str):
    """The whole model on this process (tp = 1, no process group needed)."""
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    model, _ = load_model(path, Layout((0,)), world)
    return model


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: int | None = 2) -> list[int]:
    """transformers greedy continuation, one prompt at a time (no padding), cut after EOS."""
    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


def hf_logprobs(path: str, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token given everything before it."""
    full = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf_model(path)(full).logits[0, len(prompt) - 1: -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
