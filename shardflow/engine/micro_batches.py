"""Split a batch of variable-length sequences into micro-batches bounded by a token budget.

A model call pads each micro-batch to its longest sequence, so the budget counts padded tokens:
``len(micro_batch) * longest <= max_tokens``. Sorting by length (longest first) keeps the padding
tight; cutting the sorted order into maximal runs gives the fewest micro-batches a contiguous
split of that order can have. Ties keep their input order, so the split is deterministic and
every rank of a replica, given the same lengths, computes the same one. With ``pad_multiple`` (GPUs:
``models.packed_attention.LENGTH_MULTIPLE``) the rows are padded further, to a multiple of it
within the budget, so that attention meets few distinct shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shardflow.data.batch import SequenceBatch, to_device
from shardflow.models.packed_attention import PackedSequences


def padded_width(longest: int, pad_multiple: int, max_tokens: int) -> int:
    """The row width of a micro-batch whose longest sequence is ``longest``: rounded up to a
    multiple of ``pad_multiple``, but not past the budget."""
    return max(longest, min(-(-longest // pad_multiple) * pad_multiple, max_tokens))


def split_by_tokens(lengths: Sequence[int] | torch.Tensor, max_tokens: int, *,
                    min_micro_batches: int = 1, pad_multiple: int = 1) -> list[list[int]]:
    """Indices (into ``lengths``) of each micro-batch, longest sequences first.

    ``min_micro_batches`` asks for at least that many micro-batches (as many as there are
    sequences, if fewer), e.g. one per pipeline stage so that every stage has work in flight;
    the most expensive micro-batches are halved until there are that many.
    """
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be positive, got {max_tokens}")
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be positive, got {min_micro_batches}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sequence needs at least one token, got lengths {lengths}")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    longest = lengths[order[0]]
    if longest > max_tokens:
        raise ValueError(
            f"sequence {order[0]} has {longest} tokens, more than the micro-batch budget of "
            f"{max_tokens} tokens; raise the budget to at least the longest sequence"
        )
    widths = [padded_width(n, pad_multiple, max_tokens) for n in (lengths[i] for i in order)]
    runs = _cut(widths, max_tokens)
    while len(runs) < min(min_micro_batches, len(lengths)):
        # Halve the most expensive run that has two or more sequences (the first on ties).
        cost = [(b - a) * widths[a] if b - a > 1 else -1 for a, b in runs]
        j = cost.index(max(cost))
        a, b = runs[j]
        mid = a + (b - a + 1) // 2
        runs[j:j + 1] = [(a, mid), (mid, b)]
    return [[order[i] for i in range(a, b)] for a, b in runs]


def _cut(widths: list[int], budget: int) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of a widest-first list of row widths with ``(b - a) * widest <= budget``."""
    runs, a = [], 0
    while a < len(widths):
        per_batch = budget // widths[a]  # the first of a run is its widest
        b = min(a + per_batch, len(widths))
        runs.append((a, b))
        a = b
    return runs


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One micro-batch, ready on the model's device.

    Its index tensors are built on the host (indexing with a boolean mask on a GPU waits for it)
    and reach the device by copies that queue behind its work (``data.batch.to_device``), so that
    the host builds micro-batch i + 1 while the device runs micro-batch i (``MicroBatches``).
    """

    batch: SequenceBatch  # the sequences with every field of the step's batch (fields on the device)
    ids: torch.Tensor  # [B,T] input ids, right-padded
    positions: torch.Tensor  # [B,T]
    token_index: torch.Tensor  # [num_tokens] position of each packed token in the flattened [B*T]
    # The tokens whose outputs are wanted (see ``make_micro_batches``), None for all: their packed
    # indices [n], the position in the flattened [B*T] of the hidden state before each, and their ids.
    wanted: torch.Tensor | None = None
    wanted_before: torch.Tensor | None = None
    wanted_targets: torch.Tensor | None = None
    # One row of sequences that share prompts (see ``engine.shared_prompts``); None: causal rows.
    packed: PackedSequences | None = None

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[B,T,...] -> packed [num_tokens, ...] (the inverse of the padding)."""
        return padded.flatten(0, 1)[self.token_index]


class MicroBatches(Sequence[MicroBatch]):
    """A step's micro-batches, each built when first asked for: building one is host work (index
    tensors, copies queued to the device), done while the device runs the one before instead of
    all of them before the first starts. Their [B, T] shapes are known from the plan alone (the
    pipeline's links need them up front)."""

    def __init__(self, shapes: list[tuple[int, int]], build: Callable[[int], MicroBatch]):
        self.shapes = shapes
        self._build = build
        self._built: dict[int, MicroBatch] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> MicroBatch:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"micro-batch {i} of {len(self)}")
        i %= len(self)
        if i not in self._built:
            mb = self._built[i] = self._build(i)
            assert tuple(mb.ids.shape) == self.shapes[i], (tuple(mb.ids.shape), self.shapes[i])
        return self._built[i]

    def tokens(self) -> int:
        """Tokens the layers run over, padding included."""
        return sum(b * t for b, t in self.shapes)


def make_micro_batches(batch: SequenceBatch, groups: list[list[int]], device: torch.device, *,
                       outputs_at: str | None = None, pad_multiple: int = 1,
                       max_tokens: int | None = None) -> MicroBatches:
    """The micro-batches of ``batch`` holding the sequences of each group, on ``device``, each
    padded to its longest sequence rounded up to ``pad_multiple`` (within ``max_tokens``).

    ``outputs_at``: a token field of ``batch`` (e.g. ``loss_mask``) whose nonzero tokens are the
    only ones whose per-token outputs are wanted, so that the model's head runs on their hidden
    states alone (RL losses read responses only, and prompts are often the longer part).
    """
    lengths = batch.lengths.tolist()
    widths = [padded_width(longest, pad_multiple, max_tokens or longest)
              for longest in (max(lengths[i] for i in group) for group in groups)]

    def build(i: int) -> MicroBatch:
        mb = batch.select(groups[i])
        ids = mb.padded("input_ids", length=widths[i])  # [B,T]
        width = ids.shape[1]
        rows = torch.repeat_interleave(torch.arange(len(mb)), mb.lengths)  # [num_tokens]
        cols = torch.arange(mb.num_tokens) - torch.repeat_interleave(mb.offsets[:-1], mb.lengths)
        flat = rows * width + cols
        wanted = {}
        if outputs_at is not None:
            keep = (mb.token_fields[outputs_at].cpu() > 0) & (cols > 0)
            if keep.any():  # else all outputs, zero-weighted by the same field: no empty head call
                wanted = wanted_outputs(mb, keep, flat, device)
        return MicroBatch(
            batch=mb.to(device),
            ids=to_device(ids, device),
            positions=torch.arange(width, device=device).expand(ids.shape),
            token_index=to_device(flat, device),
            **wanted,
        )

    return MicroBatches([(len(group), width) for group, width in zip(groups, widths)], build)


def wanted_outputs(mb: SequenceBatch, keep: torch.Tensor, flat: torch.Tensor,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The ``wanted*`` fields of a micro-batch for the packed tokens ``keep`` (never a sequence's
    first, which nothing predicts): indices built here, on the host, since a boolean mask indexed
    on the device waits for it. ``flat``: each packed token's position in the model's rows."""
    index = keep.nonzero()[:, 0]
    return {"wanted": to_device(index, device), "wanted_before": to_device(flat[index - 1], device),
            "wanted_targets": to_device(mb.token_fields["input_ids"].cpu()[index], device)}
