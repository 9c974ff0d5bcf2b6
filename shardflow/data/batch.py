"""SequenceBatch: the data that flows between the calls of an RL iteration.

N variable-length sequences (prompt + response). Per-token fields are packed along one token axis
(no padding: sequence i owns rows ``offsets[i] : offsets[i + 1]``); per-sequence fields have N
rows; ``meta`` holds per-sequence Python objects (e.g. reference answers). ``sample_ids`` name
each sequence globally, so that redistribution and reordering never lose track of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


def token_rows_of(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The packed token rows of sequences at ``starts`` with ``lengths`` ([S] each), sequence after
    sequence: one vectorised pass, not a slice per sequence."""
    total = int(lengths.sum()) if len(lengths) else 0
    firsts = lengths.cumsum(0) - lengths  # each sequence's first position in the result
    return torch.arange(total) + torch.repeat_interleave(starts - firsts, lengths, output_size=total)


@dataclass
class SequenceBatch:
    sample_ids: torch.Tensor  # [N] int64, unique within an iteration
    lengths: torch.Tensor  # [N] int64, tokens per sequence
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each [sum(lengths), ...]
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # each [N, ...]
    meta: dict[str, list[Any]] = field(default_factory=dict)  # each a list of N objects

    def __post_init__(self) -> None:
        n, total = len(self.sample_ids), int(self.lengths.sum()) if len(self.lengths) else 0
        if len(self.lengths) != n:
            raise ValueError(f"{len(self.lengths)} lengths for {n} sequences")
        for k, t in self.token_fields.items():
            if t.shape[0] != total:
                raise ValueError(f"token field {k!r} has {t.shape[0]} rows, expected {total} tokens")
        for k, t in self.seq_fields.items():
            if t.shape[0] != n:
                raise ValueError(f"sequence field {k!r} has {t.shape[0]} rows, expected {n} sequences")
        for k, v in self.meta.items():
            if len(v) != n:
                raise ValueError(f"meta field {k!r} has {len(v)} items, expected {n} sequences")

    # ----- sizes ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def offsets(self) -> torch.Tensor:
        """[N + 1] start of each sequence in the packed token axis."""
        return torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    # ----- building and slicing ------------------------------------------------------------

    @classmethod
    def empty(cls) -> "SequenceBatch":
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @classmethod
    def from_lists(cls, sample_ids: Sequence[int], tokens: dict[str, Sequence[torch.Tensor]],
                   seq_fields: dict[str, torch.Tensor] | None = None,
                   meta: dict[str, list[Any]] | None = None) -> "SequenceBatch":
        """From one 1-D (or [len, ...]) tensor per sequence for each token field."""
        first = next(iter(tokens.values()))
        lengths = torch.tensor([len(t) for t in first], dtype=torch.long)
        packed = {k: torch.cat(list(v)) if len(v) else torch.zeros(0) for k, v in tokens.items()}
        return cls(torch.as_tensor(list(sample_ids), dtype=torch.long), lengths, packed,
                   dict(seq_fields or {}), dict(meta or {}))

    def select(self, index: Sequence[int] | torch.Tensor) -> "SequenceBatch":
        """The sequences at ``index`` (in that order)."""
        index = torch.as_tensor(index, dtype=torch.long)
        token_rows = token_rows_of(self.offsets[:-1][index], self.lengths[index])
        return SequenceBatch(
            self.sample_ids[index],
            self.lengths[index],
            {k: v[token_rows.to(v.device)] for k, v in self.token_fields.items()},
            {k: v[index.to(v.device)] for k, v in self.seq_fields.items()},
            {k: [v[i] for i in index.tolist()] for k, v in self.meta.items()},
        )

    @staticmethod
    def concat(batches: Iterable["SequenceBatch"]) -> "SequenceBatch":
        batches = [b for b in batches if len(b)]
        if not batches:
            return SequenceBatch.empty()
        keys = lambda b: (set(b.token_fields), set(b.seq_fields), set(b.meta))  # noqa: E731
        if any(keys(b) != keys(batches[0]) for b in batches):
            raise ValueError("cannot concatenate batches with different fields")
        first = batches[0]
        return SequenceBatch(
            torch.cat([b.sample_ids for b in batches]),
            torch.cat([b.lengths for b in batches]),
            {k: torch.cat([b.token_fields[k] for b in batches]) for k in first.token_fields},
            {k: torch.cat([b.seq_fields[k] for b in batches]) for k in first.seq_fields},
            {k: [x for b in batches for x in b.meta[k]] for k in first.meta},
        )

    def sorted_by_id(self) -> "SequenceBatch":
        return self.select(torch.argsort(self.sample_ids))

    def update(self, token_fields: dict[str, torch.Tensor] | None = None,
               seq_fields: dict[str, torch.Tensor] | None = None,
               meta: dict[str, list[Any]] | None = None) -> "SequenceBatch":
        """A batch with extra (or replaced) fields, sharing the existing tensors."""
        return SequenceBatch(self.sample_ids, self.lengths, {**self.token_fields, **(token_fields or {})},
                             {**self.seq_fields, **(seq_fields or {})}, {**self.meta, **(meta or {})})

    def to(self, device: torch.device | str) -> "SequenceBatch":
        return SequenceBatch(self.sample_ids, self.lengths,
                             {k: to_device(v, device) for k, v in self.token_fields.items()},
                             {k: to_device(v, device) for k, v in self.seq_fields.items()}, self.meta)

    # ----- padded views for model calls ----------------------------------------------------

    def padded(self, key: str, pad_value: float | int = 0, length: int | None = None) -> torch.Tensor:
        """Token field ``key`` as [N, T] (right-padded with ``pad_value``), T = longest sequence."""
        values = self.token_fields[key]
        n = len(self)
        width = int(self.lengths.max()) if n else 0
        width = max(width, length or 0)
        out = values.new_full((n, width, *values.shape[1:]), pad_value)
        mask = self.token_mask(width).to(values.device)
        out[mask] = values
        return out

    def token_mask(self, width: int | None = None) -> torch.Tensor:
        """[N, T] True at real tokens."""
        width = width if width is not None else (int(self.lengths.max()) if len(self) else 0)
        return torch.arange(width)[None, :] < self.lengths[:, None]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Inverse of ``padded``: [N, T, ...] -> packed [sum(lengths), ...]."""
        return padded[self.token_mask(padded.shape[1]).to(padded.device)]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t.to(device)``, where a copy from host memory to a GPU goes through pinned memory and does
    not wait: it queues behind the work already on the device (a copy from pageable memory waits
    for all of it), and the pinned buffer is not reused before the copy has read it."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
