"""What a training loss gives the engine, and what the engine gives it.

The engine runs ``loss_fn`` once per micro-batch on the last pipeline stage. To make a mean over
the whole step exact however the batch is split into micro-batches and data-parallel replicas,
a loss divides by a *global* count, the normalizer, instead of averaging per micro-batch:

    step loss = sum over replicas and micro-batches of loss_fn(...)[0]

e.g. a token-mean loss returns ``(per_token * mask).sum() / normalizer`` where the normalizer is
the number of response tokens in the whole step. The engine obtains it by summing
``loss_fn.normalizer(batch)`` over the data-parallel replicas.

Stats follow the same rule: each is a contribution that the engine sums over micro-batches and
replicas (divide by the normalizer for a mean). Sums of contributions are all it can report.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardflow.data.batch import SequenceBatch


class LossFn(Protocol):
    # Whether outputs["entropy"] carries a gradient (an entropy bonus). Otherwise the entropy is
    # detached and only serves stats, which saves the memory its backward needs.
    entropy_grad: bool

    def normalizer(self, batch: SequenceBatch) -> float:
        """This replica's count (e.g. response tokens of ``batch``, its whole share of the step);
        the engine sums it over the replicas and passes the total to every call."""
        ...

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: SequenceBatch,
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (0-d tensor) and stats of one micro-batch.

        ``outputs``: packed float32 per-token fields of ``micro_batch`` aligned as the
        conventions say (``field[t]`` is about ``ids[t]``; ``field[0]`` is 0; a batch with a
        ``loss_mask`` gets them at its tokens only, 0 elsewhere):
        ``{"logprobs", "entropy"}`` for a language model, ``{"values"}`` for a value model.
        ``micro_batch`` holds the same sequences with every field of the step's batch, on the
        model's device. Stats: 0-d tensors (no ``.item()``: that would wait on the device).
        """
        ...
