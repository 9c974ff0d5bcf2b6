"""Prompt datasets and the seeded, resumable order in which they are used.

Each row (from a file or a Hugging Face dataset: ``data.sources``) holds a prompt, as text
(``data.prompt_key``) or chat messages (``data.messages_key``), and a reference answer
(``data.answer_key``). Everything is read, checked and tokenized up front, so a bad row stops the
run before any rank starts, with the row named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from shardflow.config.experiment import DataConfig
from shardflow.data.batch import SequenceBatch
from shardflow.data.sources import Source, dataset_rows, source_of


@dataclass(frozen=True, kw_only=True)
class Prompt:
    index: int  # position in the dataset (0-based), also the GRPO group id of its samples
    text: str  # the prompt as the model sees it (chat template applied)
    ids: tuple[int, ...]  # its token ids
    answer: Any  # reference answer, passed to the reward as is (None when the row has none)
    # offline rows: the token ids of each completion the row gives (SFT's response; DPO's chosen,
    # then rejected), each ending with the end-of-sequence token
    completions: tuple[tuple[int, ...], ...] = ()
    row: dict | None = None  # the whole row, for a multi-turn environment (``keep_rows``)


def load_prompts(config: DataConfig, tokenizer, *, source: Source | None = None, require_answer: bool = True,
                 completions: tuple[str, ...] = (), tools: list[dict] | None = None,
                 keep_rows: bool = False) -> list[Prompt]:
    """Read, check and tokenize every prompt of ``source`` (default: ``config``'s own dataset),
    its columns named by ``config``'s keys; with ``completions`` (data keys such as
    ``data.response_key``), each row's completions under those fields too. ``tools``: the JSON
    schemas the chat template renders into each prompt; ``keep_rows``: keep each row."""
    source = source or source_of(config, "data")
    if config.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"data.chat_template is on but the tokenizer has no chat template ({source.name}); "
                         "set data.chat_template=false to use prompts as plain text")
    columns = tuple(completions) + ((config.answer_key,) if require_answer else ())
    rows = dataset_rows(source, columns=columns, any_of=(config.prompt_key, config.messages_key))
    prompts = [_prompt(row, where, i, config, tokenizer, require_answer, completions, tools, keep_rows)
               for i, (where, row) in enumerate(rows)]
    if not prompts:
        raise ValueError(f"{source.key} dataset {source.name} has no rows")
    return prompts


def _prompt(row: Any, where: str, index: int, config: DataConfig, tokenizer, require_answer: bool,
            completions: tuple[str, ...] = (), tools: list[dict] | None = None, keep_row: bool = False) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with a prompt, got {type(row).__name__}")
    messages = row.get(config.messages_key)
    if messages is not None:
        _check_messages(messages, where, config.messages_key)
        if not config.chat_template:
            raise ValueError(f"{where}: chat messages need data.chat_template=true")
    else:
        prompt = row.get(config.prompt_key)
        if prompt is None:
            raise ValueError(f"{where}: no {config.prompt_key!r} or {config.messages_key!r} field "
                             f"(fields: {sorted(row)})")
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: {config.prompt_key!r} must be text, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError(f"{where}: empty prompt")
        messages = [{"role": "user", "content": prompt}] if config.chat_template else None
        text = prompt
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    # the template writes any BOS itself; a plain prompt gets the tokenizer's usual special tokens
    ids = tokenizer(text, add_special_tokens=messages is None)["input_ids"]
    if not ids:
        raise ValueError(f"{where}: the prompt has no tokens")
    if len(ids) > config.max_prompt_tokens:
        raise ValueError(f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens "
                         f"= {config.max_prompt_tokens}")
    answer = row.get(config.answer_key)
    if require_answer and answer is None:
        raise ValueError(f"{where}: no {config.answer_key!r} field (the reward needs a reference answer)")
    return Prompt(index=index, text=text, ids=tuple(ids), answer=answer,
                  completions=tuple(_completion(row, where, key, tokenizer) for key in completions),
                  row=row if keep_row else None)


def _completion(row: dict, where: str, key: str, tokenizer) -> tuple[int, ...]:
    """A completion's ids, after the prompt's: its text's tokens and the end-of-sequence token."""
    text = row.get(key)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: no text {key!r} field (fields: {sorted(row)})")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(ids) + ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())


def _check_messages(messages: Any, where: str, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {i} must have text 'role' and 'content', got {m!r:.100}")
    if not any(m["content"].strip() for m in messages):
        raise ValueError(f"{where}: empty prompt (every message is empty)")


def prompt_batch(prompts: list[Prompt]) -> SequenceBatch:
    """The ``prompts`` batch of an iteration: token field ``input_ids``, seq field
    ``prompt_index`` (dataset position), meta ``answers`` and ``prompts`` (text)."""
    return SequenceBatch.from_lists(
        range(len(prompts)),
        {"input_ids": [torch.tensor(p.ids, dtype=torch.long) for p in prompts]},
        {"prompt_index": torch.tensor([p.index for p in prompts], dtype=torch.long)},
        {"answers": [p.answer for p in prompts], "prompts": [p.text for p in prompts]},
    )


def completion_batch(prompts: list[Prompt]) -> SequenceBatch:
    """The sequences of offline rows: each completion after its prompt, the loss on the completion
    (token field ``loss_mask``). Sample ``k * i + j`` is completion ``j`` of the iteration's row
    ``i`` (``k`` completions per row); seq fields ``prompt_index`` (the row's dataset position),
    ``prompt_lengths`` and ``completion`` (``j``: 0 for DPO's chosen, 1 for its rejected)."""
    k = len(prompts[0].completions) if prompts else 0
    ids, masks, index, lengths, which = [], [], [], [], []
    for p in prompts:
        for j, completion in enumerate(p.completions):
            ids.append(torch.tensor(p.ids + completion, dtype=torch.long))
            masks.append(torch.cat([torch.zeros(len(p.ids)), torch.ones(len(completion))]))
            index.append(p.index)
            lengths.append(len(p.ids))
            which.append(j)
    return SequenceBatch.from_lists(range(k * len(prompts)), {"input_ids": ids, "loss_mask": masks},
                                    {"prompt_index": torch.tensor(index), "prompt_lengths": torch.tensor(lengths),
                                     "completion": torch.tensor(which)})


class PromptSampler:
    """Batches of dataset positions: epoch after epoch, each epoch a permutation seeded by
    (seed, epoch) (or the file order without shuffling), cut into full batches (an epoch's last
    partial batch is skipped so that every iteration has ``batch_size`` prompts). The position is
    two integers, saved with ``state_dict`` and restored with ``load_state_dict``."""

    def __init__(self, num_prompts: int, batch_size: int, *, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if num_prompts < batch_size:
            raise ValueError(f"the dataset has {num_prompts} prompts, fewer than one batch of {batch_size}")
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch, self.step = 0, 0  # step = batches already taken from this epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """[num_prompts] dataset positions in the order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next_batch(self) -> list[int]:
        if self.step == self.batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        start = self.step * self.batch_size
        self.step += 1
        return self.order(self.epoch)[start:start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "num_prompts": self.num_prompts,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_prompts", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the prompt order: {key} was {state[key]} when saved, "
                                 f"now {getattr(self, key)}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
