"""Sharded forward against transformers, per family and per (pp, dp, tp) layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardflow.engine.inference import hidden_states
from shardflow.models.checkpoint import load_model
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout

# (pp, dp, tp) from the foundation's acceptance list; tp=4 runs on checkpoints with 2 KV heads.
LAYOUTS = ["d1p1t1@0", "d1p2t1@0-1", "d1p1t2@0-1", "d1p1t4@0-3", "d2p1t2@0-3", "d1p2t2@0-3", "d2p2t2@0-7"]
# float32 throughout; tp changes only the summation order of row-parallel products, which moves
# results by a few ulps of values of magnitude ~1-10.
ATOL = 2e-5

CASES = {
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", tie_word_embeddings=True),
    "llama3_rope": dict(family="llama3"),
    "mistral_window": dict(family="mistral"),
    "qwen2_bias": dict(family="qwen2", vocab_size=130),  # vocab padded to a multiple of tp
    "qwen3_qknorm": dict(family="qwen3", tie_word_embeddings=True),
    "llama_value": dict(family="llama", value_head=True),
    "qwen3_value": dict(family="qwen3", value_head=True),
}


def make_batch(vocab: int, seed: int = 0):
    """Four right-padded sequences of different lengths (longer than the Mistral window of 16)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([40, 23, 31, 9])
    ids = torch.randint(3, vocab, (4, 40), generator=g)
    ids[torch.arange(40)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def forward_job(world, path: str, layout_texts: list[str], ids: torch.Tensor):
    layouts = [Layout.parse(t) for t in layout_texts]
    world.create_groups(layouts)
    results = {}
    for layout in layouts:
        if world.rank not in layout:
            continue
        model, shard = load_model(path, layout, world)
        c = layout.coord(world.rank)
        rows = torch.arange(c.dp, ids.shape[0], layout.dp)  # this replica's share of the batch
        mine = ids[rows]
        positions = torch.arange(mine.shape[1]).expand_as(mine)
        with comm.count_collectives() as counts:
            hidden = hidden_states(model, layout, world, [(mine, positions)])
            if not shard.last_stage:
                continue
            [h] = hidden
            with torch.no_grad():
                if model.cfg.value_head:
                    out = {"values": model.values(h)}
                else:
                    logprobs = model.token_logprobs(h, mine.roll(-1, dims=1))
                    counted = dict(counts)
                    logits = comm.all_gather(model.logits(h), model.tp_group)[..., : model.cfg.vocab_size]
                    out = {"logits": logits, "logprobs": logprobs, "counts": counted}
        if c.tp == 0:
            results[str(layout)] = (rows, out)
    return results


def reference(path: str, ids: torch.Tensor, value_head: bool):
    auto = transformers.AutoModelForSequenceClassification if value_head else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        if value_head:
            return {"values": model.score(model.model(ids).last_hidden_state).squeeze(-1)}
        logits = model(ids).logits
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids.roll(-1, dims=1).unsqueeze(-1)).squeeze(-1)
        return {"logits": logits, "logprobs": logprobs}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forward_matches_transformers(pool, checkpoints, case):
    kwargs = dict(CASES[case])
    family = kwargs.pop("family")
    path = checkpoints.get(case, family, **kwargs)
    value_head = kwargs.get("value_head", False)
    ids, lengths = make_batch(kwargs.get("vocab_size", 128))
    ref = reference(path, ids, value_head)
    valid = torch.arange(ids.shape[1])[None, :] < (lengths[:, None] - 1)  # positions with a next token

    merged: dict[str, dict[str, torch.Tensor]] = {}
    for rank_results in pool.run(forward_job, path, LAYOUTS, ids):
        for layout, (rows, out) in rank_results.items():
            dest = merged.setdefault(layout, {k: torch.full_like(v, float("nan")) for k, v in ref.items()})
            for key in ref:
                dest[key][rows] = out[key]
    assert sorted(merged) == sorted(str(Layout.parse(t)) for t in LAYOUTS)
    for layout, out in merged.items():
        for key, expected in ref.items():
            got = out[key]
            torch.testing.assert_close(got[valid], expected[valid], atol=ATOL, rtol=0, msg=f"{case} {layout} {key}")


def test_collectives_per_layer(pool, checkpoints):
    """tp=2 forward: one all-reduce for the embedding, two per layer, two for log-probs (with the
    entropy: the row maximum, then three sums in one)."""
    path = checkpoints.get("llama", "llama")
    ids, _ = make_batch(128)
    results = pool.run(forward_job, path, ["d1p1t2@0-1"], ids)
    counts = results[0]["d1p1t2@0-1"][1]["counts"]
    layers = 4
    assert counts == {"all_reduce": 1 + 2 * layers + 2}
