"""Per-token outputs of the last pipeline stage, aligned and packed as the conventions say.

``field[t]`` describes ``ids[t]`` given ``ids[:t]``: the log-probability of ``ids[t]``, the
entropy of the distribution that produced it, the value of the state before it. All come from
the hidden state at ``t - 1``, so the model runs its head on positions ``0 .. T-2`` and the
result is shifted right by one; ``field[0]`` is 0. Outputs are float32, packed like the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardflow.engine.micro_batches import MicroBatch
from shardflow.models.transformer import Transformer

LM_OUTPUTS = ("logprobs", "entropy")
VALUE_OUTPUTS = ("values",)


def check_outputs(model: Transformer, names: tuple[str, ...]) -> None:
    """Raise ValueError if the model cannot produce one of ``names``."""
    allowed = VALUE_OUTPUTS if model.cfg.value_head else LM_OUTPUTS
    kind = "a value model" if model.cfg.value_head else "a language model"
    for name in names:
        if name not in allowed:
            raise ValueError(f"{kind} produces {' or '.join(allowed)}, not {name!r}")


def token_outputs(model: Transformer, hidden: torch.Tensor, mb: MicroBatch, names: tuple[str, ...], *,
                  temperature: float = 1.0, entropy_grad: bool = False) -> dict[str, torch.Tensor]:
    """``names`` of the outputs for the hidden states [B,T,H] of micro-batch ``mb``; each packed
    [num_tokens] float32. Log-probabilities and values carry gradients when grad is enabled;
    entropy only with ``entropy_grad``."""
    ids = mb.ids  # [B,T]
    before = hidden[:, :-1]  # [B,T-1,H] hidden states that predict ids[:, 1:]
    out: dict[str, torch.Tensor] = {}
    if model.cfg.value_head:
        out["values"] = model.values(before).float()  # [B,T-1]
    else:
        # Both from one pass over the logits (the entropy costs nothing extra).
        out["logprobs"], entropy = model.token_stats(before, ids[:, 1:], temperature)
        out["entropy"] = entropy if entropy_grad else entropy.detach()
    return {k: mb.pack(F.pad(v, (1, 0))) for k, v in out.items() if k in names}
