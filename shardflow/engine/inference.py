"""Forward-only inference calls: per-token log-probabilities, entropy or values of a batch.

Every rank of the layout calls ``infer`` with its data-parallel replica's share of the batch.
Micro-batches bounded by a token budget flow through the pipeline stages; the last stage turns
hidden states into the requested output. The result stays where the conventions say: on the
replica's last-stage ranks (each tp rank holds an identical copy); other ranks get None.
"""

from __future__ import annotations

import torch

from shardflow.data.batch import SequenceBatch
from shardflow.engine.outputs import check_outputs, token_outputs
from shardflow.engine.pipeline import StageLinks, forward_only
from shardflow.engine.shared_prompts import plan_micro_batches
from shardflow.models.transformer import Transformer
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World


@torch.no_grad()
def infer(model: Transformer, layout: Layout, world: World, batch: SequenceBatch, what: str, *,
          micro_batch_tokens: int, temperature: float = 1.0, outputs_at: str | None = None,
          share_prompts: bool = False, attention: str = "auto") -> SequenceBatch | None:
    """``batch`` with a new packed float32 token field ``what`` ("logprobs" or "entropy" for a
    language model, "values" for a value model), aligned as the conventions say, on the last
    stage; None on other stages. ``temperature`` divides the logits (as in sampling).
    ``outputs_at``: a token field of ``batch`` whose nonzero tokens alone get outputs (0 elsewhere).
    ``share_prompts``: the samples of a prompt hold one copy of it (see ``engine.shared_prompts``),
    attended by the ``attention`` kernel (``models.packed_attention``)."""
    check_outputs(model, (what,))
    if model.shard.layout != layout or model.shard.rank != world.rank:
        raise ValueError(f"the model was built for rank {model.shard.rank} of {model.shard.layout}, "
                         f"not rank {world.rank} of {layout}")
    if "input_ids" not in batch.token_fields:
        raise ValueError(f"inference batch lacks token field 'input_ids' (has {sorted(batch.token_fields)})")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    shard = model.shard
    param = next(iter(model.parameters()))
    device, dtype = param.device, param.dtype
    if outputs_at is not None and outputs_at not in batch.token_fields:
        raise ValueError(f"inference batch lacks token field {outputs_at!r} (has {sorted(batch.token_fields)})")
    fields = ("input_ids",) if outputs_at is None else ("input_ids", outputs_at)
    needed = SequenceBatch(batch.sample_ids, batch.lengths, {k: batch.token_fields[k] for k in fields})
    groups, micro = plan_micro_batches(  # no other field goes to the device
        needed, micro_batch_tokens, device, min_micro_batches=layout.pp, outputs_at=outputs_at,
        share_prompts=share_prompts and not model.has_sliding_windows, attention=attention)
    results: list[torch.Tensor] = []  # packed output of each micro-batch (last stage)

    def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        mb = micro[i]
        hidden = model(mb.ids if shard.first_stage else x, mb.positions, packed=mb.packed)  # [B,T,H]
        if not shard.last_stage:
            return hidden
        results.append(token_outputs(model, hidden, mb, (what,), temperature=temperature)[what])
        return None

    shapes = [(*shape, model.cfg.hidden_size) for shape in micro.shapes]
    pp_group = world.groups.get(layout.pp_group(world.rank))
    forward_only(StageLinks.of(layout, world.rank, pp_group, shapes, dtype, device), forward_step)
    if not shard.last_stage:
        return None
    # Back to the batch's order: micro-batch outputs cover the sequences in `groups` order.
    offsets = batch.offsets.tolist()
    rows = [torch.arange(offsets[s], offsets[s + 1]) for group in groups for s in group]
    out = torch.empty(batch.num_tokens, dtype=torch.float32, device=device)  # [num_tokens]
    if rows:
        out[torch.cat(rows).to(device)] = torch.cat(results)
    target = batch.token_fields["input_ids"].device
    return batch.update(token_fields={what: out.to(target)})


@torch.no_grad()
def hidden_states(model: Transformer, layout: Layout, world: World,
                  micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
    """The last stage's hidden states [B,T,H] for each micro-batch of (ids [B,T], positions [B,T])
    through this rank's pipeline; None off the last stage. Every rank of the replica passes the
    same shapes (the layout's pipeline groups must exist)."""
    shard = model.shard
    param = next(iter(model.parameters()))
    outputs: list[torch.Tensor] = []

    def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        ids, positions = (t.to(param.device) for t in micro_batches[i])
        hidden = model(ids if shard.first_stage else x, positions)
        if not shard.last_stage:
            return hidden
        outputs.append(hidden)
        return None

    shapes = [(*ids.shape, model.cfg.hidden_size) for ids, _ in micro_batches]
    pp_group = world.groups.get(layout.pp_group(world.rank))
    forward_only(StageLinks.of(layout, world.rank, pp_group, shapes, param.dtype, param.device), forward_step)
    return outputs if shard.last_stage else None
