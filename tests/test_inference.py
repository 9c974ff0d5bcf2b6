"""Forward-only inference (log-probs, entropy, values) under (pp, dp, tp) against transformers."""

from __future__ import annotations

import pytest
import torch
import transformers
from train_reference import make_batch, reference_outputs, replica_share

from shardflow.data.batch import SequenceBatch
from shardflow.engine.inference import infer
from shardflow.models.checkpoint import load_model
from shardflow.parallel.layout import Layout

TEMPERATURE = 0.7
CASES = {
    "llama": (dict(family="llama"), ["d1p1t1@0", "d1p2t1@0-1", "d1p1t4@0-3", "d2p2t2@0-7"], ("logprobs", "entropy")),
    "qwen3_qknorm": (dict(family="qwen3", tie_word_embeddings=True), ["d1p2t2@0-3"], ("logprobs",)),
    "llama_value": (dict(family="llama", value_head=True), ["d2p2t2@0-7"], ("values",)),
}


def infer_job(world, path: str, layout_texts: list[str], batch: SequenceBatch, whats: tuple[str, ...],
              **options):
    """``options`` go to ``infer`` (a 48-token budget and TEMPERATURE unless given)."""
    options = {"micro_batch_tokens": 48, "temperature": TEMPERATURE, **options}
    layouts = [Layout.parse(t) for t in layout_texts]
    world.create_groups(layouts)
    out = {}
    for layout in layouts:
        if world.rank not in layout:
            continue
        model, shard = load_model(path, layout, world)
        share = replica_share(batch, layout, world.rank)
        for what in whats:
            result = infer(model, layout, world, share, what, **options)
            assert (result is None) == (not shard.last_stage)
            if result is not None:
                assert torch.equal(result.sample_ids, share.sample_ids)  # the batch's own order
                out[(str(layout), what, world.rank)] = (result.sample_ids, result.token_fields[what])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_inference_matches_transformers(pool, checkpoints, case):
    kwargs, layouts, whats = CASES[case]
    kwargs = dict(kwargs)
    path = checkpoints.get(case, kwargs.pop("family"), **kwargs)
    value_head = kwargs.get("value_head", False)
    batch = make_batch(128, num=9, seed=3)
    auto = transformers.AutoModelForSequenceClassification if value_head else transformers.AutoModelForCausalLM
    with torch.no_grad():
        ref = reference_outputs(auto.from_pretrained(path, dtype=torch.float32), batch, value_head, TEMPERATURE)

    results = {}
    for part in pool.run(infer_job, path, layouts, batch, whats):
        results.update(part)
    for text in layouts:
        layout = Layout.parse(text)
        for what in whats:
            # every last-stage rank (each tp index of each replica) holds its replica's result
            pieces = {r: results[(str(layout), what, r)] for r in layout.stage_ranks(layout.pp - 1)}
            for d in range(layout.dp):
                held = [pieces[layout.rank_at(layout.pp - 1, d, t)] for t in range(layout.tp)]
                assert all(torch.equal(h[1], held[0][1]) for h in held), f"{text} tp copies differ"
            replicas = []
            for d in range(layout.dp):
                ids, field = pieces[layout.rank_at(layout.pp - 1, d, 0)]
                share = replica_share(batch, layout, layout.rank_at(0, d, 0))
                replicas.append(SequenceBatch(ids, share.lengths, {what: field}))
            got = SequenceBatch.concat(replicas).sorted_by_id().token_fields[what]
            assert not got[batch.offsets[:-1]].any()  # field[0] = 0 for every sequence
            # float32; tp and pipeline change summation orders only (a few ulps of values ~1-10)
            torch.testing.assert_close(got, ref[what], atol=2e-5, rtol=0, msg=f"{case} {text} {what}")


def test_inference_refuses_what_the_model_cannot_produce(checkpoints):
    from shardflow.parallel.world import World

    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    model, _ = load_model(checkpoints.get("llama", "llama"), Layout((0,)), world)
    with pytest.raises(ValueError, match="a language model produces logprobs or entropy, not 'values'"):
        infer(model, Layout((0,)), world, make_batch(128), "values", micro_batch_tokens=64)


@pytest.mark.parametrize("value_head", [False, True])
def test_outputs_at_response_tokens_only(checkpoints, value_head):
    """With ``outputs_at``, the head runs on the hidden states before the response tokens alone
    (RL calls read nothing else); their outputs equal transformers', the rest are 0."""
    from shardflow.parallel.world import World

    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    path = checkpoints.get("llama_value" if value_head else "llama", "llama", value_head=value_head)
    model, _ = load_model(path, Layout((0,)), world)
    batch = make_batch(128, num=9, seed=4)
    what = "values" if value_head else "logprobs"
    auto = transformers.AutoModelForSequenceClassification if value_head else transformers.AutoModelForCausalLM
    with torch.no_grad():
        ref = reference_outputs(auto.from_pretrained(path, dtype=torch.float32), batch, value_head)[what]
    head_rows = []
    name = "values" if value_head else "token_stats"  # the LM head runs inside token_stats
    head = getattr(model, name)

    def recording(hidden, *args, **kwargs):
        head_rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return head(hidden, *args, **kwargs)

    setattr(model, name, recording)
    got = infer(model, Layout((0,)), world, batch, what, micro_batch_tokens=64,
                outputs_at="loss_mask").token_fields[what]
    first = torch.zeros(batch.num_tokens, dtype=torch.bool)
    first[batch.offsets[:-1]] = True
    wanted = (batch.token_fields["loss_mask"] > 0) & ~first
    assert sum(head_rows) == int(wanted.sum()) < batch.num_tokens - len(batch)  # fewer rows than every position
    torch.testing.assert_close(got[wanted], ref[wanted], atol=2e-5, rtol=0)
    assert not got[~wanted].any()
    with pytest.raises(ValueError, match="lacks token field 'advantage'"):
        infer(model, Layout((0,)), world, batch, what, micro_batch_tokens=64, outputs_at="advantage")
