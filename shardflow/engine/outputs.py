"""Per-token outputs of the last pipeline stage, aligned and packed as the conventions say.

``field[t]`` describes ``ids[t]`` given ``ids[:t]``: the log-probability of ``ids[t]``, the
entropy of the distribution that produced it, the value of the state before it. All come from
the hidden state at ``t - 1``, so the model runs its head on positions ``0 .. T-2`` and the
result is shifted right by one; ``field[0]`` is 0. A micro-batch that names the tokens it wants
(RL calls: the response tokens of ``loss_mask``) gets the head run on the hidden states before
those alone, and 0 elsewhere. Outputs are float32, packed like the batch.
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
    [num_tokens] float32, 0 at tokens the micro-batch does not want (see ``make_micro_batches``).
    Log-probabilities and values carry gradients when grad is enabled; entropy only with
    ``entropy_grad``."""
    if mb.wanted is not None:  # the head on the wanted tokens' hidden states only, 0 elsewhere
        out = _head_outputs(model, hidden.flatten(0, 1)[mb.wanted_before], mb.wanted_targets,
                            temperature, entropy_grad)  # each [n]
        total = len(mb.token_index)
        return {k: v.new_zeros(total).index_put((mb.wanted,), v) for k, v in out.items() if k in names}
    if mb.packed is not None:
        raise ValueError("a micro-batch of shared prompts names its wanted tokens")
    before = hidden[:, :-1]  # [B,T-1,H] hidden states that predict ids[:, 1:]
    out = _head_outputs(model, before, mb.ids[:, 1:], temperature, entropy_grad)  # each [B,T-1]
    return {k: mb.pack(F.pad(v, (1, 0))) for k, v in out.items() if k in names}


def _head_outputs(model: Transformer, before: torch.Tensor, targets: torch.Tensor, temperature: float,
                  entropy_grad: bool) -> dict[str, torch.Tensor]:
    """Float32 outputs [...] from hidden states [..., H] and the tokens [...] they predict."""
    if model.cfg.value_head:
        return {"values": model.values(before).float()}
    # Both from one pass over the logits (the entropy costs nothing extra).
    logprobs, entropy = model.token_stats(before, targets, temperature)
    return {"logprobs": logprobs, "entropy": entropy if entropy_grad else entropy.detach()}
