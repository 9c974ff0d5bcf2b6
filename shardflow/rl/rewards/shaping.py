"""Changes to the rewards and the loss mask that depend on the responses' lengths (DAPO)."""

from __future__ import annotations

import torch

from shardflow.data.batch import SequenceBatch


def response_lengths(batch: SequenceBatch) -> torch.Tensor:
    """[N] response tokens of each sequence (``loss_mask`` > 0)."""
    seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths.cpu())
    mask = (batch.token_fields["loss_mask"].cpu() > 0).long()
    return torch.zeros(len(batch), dtype=torch.long).index_add_(0, seq, mask)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """[N] DAPO's soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then falling
    linearly to -``penalty`` at ``max_len``."""
    if buffer <= 0:
        return torch.zeros(len(lengths))
    over = (lengths.double() - (max_len - buffer)).clamp(min=0) / buffer
    return (-penalty * over.clamp(max=1.0)).float()


def shape_overlong(batch: SequenceBatch, *, max_len: int, buffer: int, penalty: float,
                   filter_truncated: bool) -> SequenceBatch:
    """``batch`` with the overlong penalty added to its ``rewards`` and, with ``filter_truncated``,
    the responses that reached ``max_len`` masked out of the loss."""
    lengths = response_lengths(batch)
    out = batch
    if buffer > 0:
        rewards = batch.seq_fields["rewards"].float().cpu()
        out = out.update(seq_fields={"rewards": rewards + overlong_penalty(lengths, max_len=max_len, buffer=buffer,
                                                                          penalty=penalty)})
    if filter_truncated:
        seq = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths.cpu())
        keep = (lengths < max_len).float()[seq]
        out = out.update({"loss_mask": batch.token_fields["loss_mask"].cpu() * keep})
    return out
