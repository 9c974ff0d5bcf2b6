"""Micro-batches in which the samples of a prompt hold one copy of it.

GRPO (and any run with several samples per prompt) trains on n sequences that begin with the same
prompt. Padded rows run that prompt through every layer n times. Here a prompt's samples share
one packed row: the prompt once, then each sample's own tokens; attention lets each sample read
the prompt and then its own tokens (``models.packed_attention``), at the positions it has in its
own sequence. Every output equals the unshared one; the prompt's work is done once, not n times.

A sample's prompt is what precedes its first wanted token (the RL losses read response tokens
only: ``loss_mask``); samples share it when those token ids are identical. Micro-batches are
bounded by packed tokens (no padding): ``prompt + sum of the samples' own tokens <= budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardflow.data.batch import SequenceBatch, to_device
from shardflow.engine.micro_batches import (
    MicroBatch,
    MicroBatches,
    make_micro_batches,
    split_by_tokens,
    wanted_outputs,
)
from shardflow.models.packed_attention import LENGTH_MULTIPLE, PackedSequences
from shardflow.perf.sharing import MIN_SAVING


def plan_micro_batches(batch: SequenceBatch, max_tokens: int, device: torch.device, *, min_micro_batches: int = 1,
                       outputs_at: str | None = None, share_prompts: bool = False, attention: str = "auto",
                       ) -> tuple[list[list[int]], MicroBatches]:
    """The batch's samples (indices) in each micro-batch, and the micro-batches on ``device``:
    prompts shared when asked (which needs ``outputs_at``) and when that saves at least
    ``MIN_SAVING`` of the padded rows' tokens, else padded rows (``micro_batches``). ``attention``:
    the shared rows' kernel (``models.packed_attention``). Each micro-batch is built when first
    used (``MicroBatches``)."""
    lengths = batch.lengths.tolist()
    pad = LENGTH_MULTIPLE if device.type == "cuda" else 1  # few shapes for cuDNN's attention plans
    groups = split_by_tokens(lengths, max_tokens, min_micro_batches=min_micro_batches, pad_multiple=pad)
    if share_prompts and outputs_at is not None:
        rows = group_by_prompt(batch, outputs_at)
        if any(len(row.samples) > 1 for row in rows):
            runs = split_rows(rows, lengths, max_tokens, min_micro_batches=min_micro_batches)
            shared = sum(row.tokens(lengths) for run in runs for row in run)
            padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
            if shared <= (1 - MIN_SAVING) * padded:
                return [samples_of(run) for run in runs], make_shared_micro_batches(
                    batch, runs, device, outputs_at=outputs_at, attention=attention)
    return groups, make_micro_batches(batch, groups, device, outputs_at=outputs_at, pad_multiple=pad,
                                      max_tokens=max_tokens)


@dataclass(frozen=True)
class SharedRow:
    """Samples (indices into the batch) that begin with the same ``prefix`` tokens."""

    prefix: int
    samples: tuple[int, ...]

    def tokens(self, lengths: list[int]) -> int:
        return self.prefix + sum(lengths[s] - self.prefix for s in self.samples)


def group_by_prompt(batch: SequenceBatch, outputs_at: str) -> list[SharedRow]:
    """One row per distinct prompt (in order of first appearance), holding its samples in order."""
    ids = batch.token_fields["input_ids"].cpu()
    wanted = batch.token_fields[outputs_at].cpu() > 0
    offsets = batch.offsets.tolist()
    rows: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(batch)):
        a, b = offsets[i], offsets[i + 1]
        first = wanted[a + 1:b].nonzero()  # token 0 has no output: a prompt holds at least it
        prefix = int(first[0]) + 1 if len(first) else b - a
        rows.setdefault(tuple(ids[a:a + prefix].tolist()), []).append(i)
    return [SharedRow(len(key), tuple(samples)) for key, samples in rows.items()]


def split_rows(rows: list[SharedRow], lengths: list[int], max_tokens: int, *,
               min_micro_batches: int = 1) -> list[list[SharedRow]]:
    """Rows of each micro-batch, largest rows first, each micro-batch within ``max_tokens``.

    Micro-batches are filled in that order; a row that does not fit the rest of one is split
    between it and the next (each part with its own copy of the prompt). ``min_micro_batches``
    (e.g. one per pipeline stage) splits the largest micro-batches, then rows, until there are
    that many or nothing is left to split.
    """
    if max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be positive, got {max_tokens}")
    for row in rows:
        for s in row.samples:
            if lengths[s] > max_tokens:
                raise ValueError(f"sequence {s} has {lengths[s]} tokens, more than the micro-batch budget of "
                                 f"{max_tokens} tokens; raise the budget to at least the longest sequence")
    fitted = sorted(rows, key=lambda r: -r.tokens(lengths))  # stable: ties keep their order
    runs: list[list[SharedRow]] = [[]]
    used = 0
    for row in fitted:
        rest = list(row.samples)
        while rest:
            part: list[int] = []  # the samples that fit what is left of the micro-batch
            while rest and used + SharedRow(row.prefix, (*part, rest[0])).tokens(lengths) <= max_tokens:
                part.append(rest.pop(0))
            if part:
                runs[-1].append(SharedRow(row.prefix, tuple(part)))
                used += runs[-1][-1].tokens(lengths)
            if rest:
                runs.append([])
                used = 0
    runs = [run for run in runs if run]
    samples = sum(len(r.samples) for r in rows)
    while len(runs) < min(min_micro_batches, samples):
        cost = [sum(r.tokens(lengths) for r in run) for run in runs]
        j = max(range(len(runs)), key=lambda i: (len(runs[i]) > 1 or len(runs[i][0].samples) > 1, cost[i]))
        run = runs[j]
        if len(run) > 1:
            half = (len(run) + 1) // 2
            runs[j:j + 1] = [run[:half], run[half:]]
        elif len(run[0].samples) > 1:
            row = run[0]
            half = (len(row.samples) + 1) // 2
            runs[j:j + 1] = [[SharedRow(row.prefix, row.samples[:half])], [SharedRow(row.prefix, row.samples[half:])]]
        else:
            break
    return runs


def make_shared_micro_batches(batch: SequenceBatch, runs: list[list[SharedRow]], device: torch.device, *,
                              outputs_at: str, attention: str = "auto") -> MicroBatches:
    """One packed row [1, T] per micro-batch; its sequences are the rows' samples in order."""
    lengths = batch.lengths.tolist()
    return MicroBatches([(1, sum(row.tokens(lengths) for row in run)) for run in runs],
                        lambda i: _shared_micro_batch(batch, runs[i], device, outputs_at, attention))


def samples_of(run: list[SharedRow]) -> list[int]:
    return [s for row in run for s in row.samples]


def _shared_micro_batch(batch: SequenceBatch, run: list[SharedRow], device: torch.device,
                        outputs_at: str, attention: str) -> MicroBatch:
    mb = batch.select(samples_of(run))
    ids = mb.token_fields["input_ids"].cpu()
    offsets, lengths = mb.offsets.tolist(), mb.lengths.tolist()
    row_ids, positions, flat, kv, q_lens, k_lens, cols = [], [], [], [], [], [], []
    at, j = 0, 0  # next packed position; next sample of mb
    for row in run:
        p = row.prefix
        prompt = torch.arange(at, at + p)
        row_ids.append(ids[offsets[j]:offsets[j] + p])
        positions.append(torch.arange(p))
        kv.append(prompt)
        q_lens.append(p)
        k_lens.append(p)
        at += p
        for _ in row.samples:
            a, n = offsets[j], lengths[j]
            own = torch.arange(at, at + n - p)
            row_ids.append(ids[a + p:a + n])
            positions.append(torch.arange(p, n))
            flat.append(torch.cat([prompt, own]))
            cols.append(torch.arange(n))
            if n > p:
                kv.append(torch.cat([prompt, own]))
                q_lens.append(n - p)
                k_lens.append(n)
            at += n - p
            j += 1
    flat_index, col = torch.cat(flat), torch.cat(cols)
    keep = (mb.token_fields[outputs_at].cpu() > 0) & (col > 0)
    if not keep.any():  # outputs at every token but the firsts, zero-weighted by the same field
        keep = col > 0
    packed = PackedSequences.build(torch.cat(kv), q_lens, k_lens, kernel=attention)
    return MicroBatch(
        batch=mb.to(device),
        ids=to_device(torch.cat(row_ids)[None], device),
        positions=to_device(torch.cat(positions)[None], device),
        token_index=to_device(flat_index, device),
        packed=packed.to(device),
        **(wanted_outputs(mb, keep, flat_index, device) if keep.any() else {}),
    )
