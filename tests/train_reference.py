"""Shared pieces of the training-engine tests: a batch, two losses, a single-process reference
step built from transformers and torch.optim.AdamW, and gathering shards into full tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardflow.config.experiment import OptimConfig
from shardflow.config.model import ModelConfig
from shardflow.data.batch import SequenceBatch
from shardflow.engine.train.optimizer import lr_at
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for


def make_batch(vocab: int, num: int = 10, seed: int = 0) -> SequenceBatch:
    """``num`` sequences of 4 to 30 tokens: a prompt, then a response with a loss mask, random
    advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 31, (num,), generator=g).tolist()
    ids, mask, adv, ret, prompts = [], [], [], [], []
    for n in lengths:
        p = int(torch.randint(1, n - 1, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (n,), generator=g))
        mask.append((torch.arange(n) >= p).float())
        adv.append(torch.randn(n, generator=g))
        ret.append(torch.randn(n, generator=g))
        prompts.append(p)
    return SequenceBatch.from_lists(
        range(100, 100 + num),
        {"input_ids": ids, "loss_mask": mask, "advantages": adv, "returns": ret},
        {"prompt_lengths": torch.tensor(prompts)},
    )


def make_group_batch(vocab: int, prompts: int = 3, samples: int = 4, seed: int = 0) -> SequenceBatch:
    """``prompts`` prompts of 2 to 8 tokens with ``samples`` responses of 1 to 11 tokens each, the
    sequences shuffled (so that a prompt's samples are not neighbours), with the fields of
    ``make_batch``."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        p = int(torch.randint(2, 9, (1,), generator=g))
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for _ in range(samples):
            r = int(torch.randint(1, 12, (1,), generator=g))
            seqs.append((torch.cat([prompt, torch.randint(3, vocab, (r,), generator=g)]), p))
    seqs = [seqs[i] for i in torch.randperm(len(seqs), generator=g).tolist()]
    fields = {
        "input_ids": [ids for ids, _ in seqs],
        "loss_mask": [(torch.arange(len(ids)) >= p).float() for ids, p in seqs],
        "advantages": [torch.randn(len(ids), generator=g) for ids, _ in seqs],
        "returns": [torch.randn(len(ids), generator=g) for ids, _ in seqs],
    }
    return SequenceBatch.from_lists(range(100, 100 + len(seqs)), fields,
                                    {"prompt_lengths": torch.tensor([p for _, p in seqs])})


def replica_share(batch: SequenceBatch, layout: Layout, rank: int) -> SequenceBatch:
    dp = layout.coord(rank).dp
    return batch.select(list(range(dp, len(batch), layout.dp)))


@dataclass
class TokenLoss:
    """A token-mean policy-gradient-like loss with a squared log-prob term and an entropy bonus."""

    entropy_grad: bool = True

    def normalizer(self, batch: SequenceBatch) -> float:
        return float(batch.token_fields["loss_mask"].sum())

    def __call__(self, outputs, mb, normalizer):
        mask, adv = mb.token_fields["loss_mask"], mb.token_fields["advantages"]
        lp, ent = outputs["logprobs"], outputs["entropy"]
        pg = (-adv * lp + 0.05 * lp * lp) * mask
        pg = pg.sum() / normalizer
        entropy = (ent * mask).sum() / normalizer
        return pg - 0.1 * entropy, {"pg": pg.detach(), "entropy": entropy.detach()}


@dataclass
class ValueLoss:
    entropy_grad: bool = False

    def normalizer(self, batch: SequenceBatch) -> float:
        return float(batch.token_fields["loss_mask"].sum())

    def __call__(self, outputs, mb, normalizer):
        err = (outputs["values"] - mb.token_fields["returns"]) * mb.token_fields["loss_mask"]
        return 0.5 * (err * err).sum() / normalizer, {}


def reference_outputs(model, batch: SequenceBatch, value_head: bool, temperature: float = 1.0):
    """Aligned packed outputs computed the plain way from a transformers model."""
    ids = batch.padded("input_ids")
    if value_head:
        v = model.score(model.model(input_ids=ids).last_hidden_state).squeeze(-1)[:, :-1]
        return {"values": batch.unpad(F.pad(v, (1, 0)))}
    logp = torch.log_softmax(model(ids).logits[:, :-1].float() / temperature, -1)  # [N,T-1,V]
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return {"logprobs": batch.unpad(F.pad(lp, (1, 0))), "entropy": batch.unpad(F.pad(ent, (1, 0)))}


def reference_step(path: str, batch: SequenceBatch, loss_fn, optim: OptimConfig, value_head: bool):
    """One step on one process: transformers forward, the loss over the whole batch,
    clip_grad_norm_, torch.optim.AdamW (decay on matrices). Returns (weights, grads, metrics)."""
    import transformers  # here, not at import: the rank pool imports this module too

    auto = transformers.AutoModelForSequenceClassification if value_head else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    loss, _ = loss_fn(reference_outputs(model, batch, value_head), batch, loss_fn.normalizer(batch))
    loss.backward()
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), optim.grad_clip or float("inf"))
    grads = {n: p.grad.clone() for n, p in params.items()}
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    torch.optim.AdamW(groups, lr=lr_at(optim, 1), betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False).step()
    weights = {n: p.detach().clone() for n, p in params.items()}
    return weights, grads, {"loss": loss.item(), "grad_norm": float(norm)}


def assemble(cfg: ModelConfig, layout: Layout, per_rank: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors (by checkpoint name) from every rank's local tensors. Every rank holding the
    same slice (dp replicas, replicated tensors, a tied head's copy) must hold it bit for bit."""
    full: dict[str, torch.Tensor] = {}
    for rank, tensors in sorted(per_rank.items()):
        for name, ts in shard_for(cfg, layout, rank).tensors.items():
            piece = tensors[name][ts.local_slices()]
            dest = full.setdefault(ts.source, torch.full(ts.full_shape, float("nan")))
            region = dest[ts.full_slices()]
            if not region.isnan().all():
                assert torch.equal(region, piece), f"{layout}: copies of {name} on rank {rank} differ"
            dest[ts.full_slices()] = piece
            if ts.padded:
                assert not tensors[name][tuple(slice(ts.stop - ts.start, None) if d == ts.dim else slice(None)
                                               for d in range(len(ts.local_shape)))].any(), f"{name} padding"
    for name, t in full.items():
        assert not t.isnan().any(), f"{layout}: no rank holds part of {name}"
    return full
