"""Shared prompts: the samples of a prompt packed into one row that holds the prompt once. The
layout, the attention over it, and inference against transformers under (pp, dp, tp) layouts
(training steps: test_train_engine.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_inference import infer_job
from train_reference import make_group_batch, reference_outputs, replica_share

from shardflow.config.load import load_config
from shardflow.data.batch import SequenceBatch
from shardflow.engine.inference import infer
from shardflow.engine.shared_prompts import (
    MIN_SAVING,
    SharedRow,
    group_by_prompt,
    make_shared_micro_batches,
    plan_micro_batches,
    split_rows,
)
from shardflow.models import packed_attention as packed_attention_module
from shardflow.models.checkpoint import load_model
from shardflow.models.packed_attention import (LENGTH_MULTIPLE, ROWS_MULTIPLE, PackedSequences, attend_rows, gather_keys,
                                               packed_attention)
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.runtime.validate import check_config

BUDGET = 40  # packed tokens per micro-batch: prompts with four samples need two rows


def hand_batch() -> SequenceBatch:
    """Prompt [5, 6, 7] with three samples, prompt [5, 6] with one, and [5, 6, 7] again."""
    seqs = [([5, 6, 7, 1, 2], 3), ([5, 6, 9], 2), ([5, 6, 7, 3], 3), ([5, 6, 7, 4, 4, 4], 3)]
    return SequenceBatch.from_lists(range(4), {
        "input_ids": [torch.tensor(s) for s, _ in seqs],
        "loss_mask": [(torch.arange(len(s)) >= p).float() for s, p in seqs],
    })


def test_samples_group_by_their_prompt_and_rows_fit_the_budget():
    batch = hand_batch()
    rows = group_by_prompt(batch, "loss_mask")
    assert rows == [SharedRow(3, (0, 2, 3)), SharedRow(2, (1,))]
    lengths = batch.lengths.tolist()
    assert rows[0].tokens(lengths) == 3 + 2 + 1 + 3
    assert split_rows(rows, lengths, 100) == [[SharedRow(3, (0, 2, 3)), SharedRow(2, (1,))]]
    # 8 tokens: the three samples need two rows, each with its own copy of the prompt
    assert split_rows(rows, lengths, 8) == [[SharedRow(3, (0, 2))], [SharedRow(3, (3,))], [SharedRow(2, (1,))]]
    # one micro-batch per pipeline stage: the largest are split, micro-batches first, then rows
    assert split_rows(rows, lengths, 100, min_micro_batches=3) == [
        [SharedRow(3, (0, 2))], [SharedRow(3, (3,))], [SharedRow(2, (1,))]]
    with pytest.raises(ValueError, match="sequence 3 has 6 tokens, more than the micro-batch budget of 5"):
        split_rows(rows, lengths, 5)
    # four prompts of 2 tokens with 3 samples of 4 own tokens (14 tokens a row) in micro-batches of
    # 20: rows split to fill them, 3 micro-batches where whole rows would need 4
    rows = [SharedRow(2, (3 * i, 3 * i + 1, 3 * i + 2)) for i in range(4)]
    runs = split_rows(rows, [6] * 12, 20)
    assert [[(r.samples) for r in run] for run in runs] == [[(0, 1, 2), (3,)], [(4, 5), (6, 7)], [(8,), (9, 10, 11)]]
    assert all(sum(r.tokens([6] * 12) for r in run) <= 20 for run in runs)


def test_micro_batches_are_built_when_first_used_with_the_planned_shapes():
    """The pipeline needs every shape before the first micro-batch runs; each micro-batch is built
    (host work, copies queued to the device) only when the pipeline reaches it, once."""
    batch = make_group_batch(64)
    for share in (True, False):
        _, micro = plan_micro_batches(batch, 40, torch.device("cpu"), outputs_at="loss_mask", share_prompts=share)
        built = []
        build = micro._build
        micro._build = lambda i: built.append(i) or build(i)
        shapes = list(micro.shapes)
        assert len(micro) > 2 and built == []
        last = micro[-1]
        assert built == [len(micro) - 1] and micro[len(micro) - 1] is last
        assert [tuple(mb.ids.shape) for mb in micro] == shapes
        assert sorted(built) == list(range(len(micro))) and micro.tokens() == sum(b * t for b, t in shapes)
        with pytest.raises(IndexError):
            micro[len(micro)]


def test_prompts_are_shared_only_where_that_saves_tokens():
    batch = make_group_batch(128)  # prompts of 2-8 tokens, responses of 1-11
    def plan(b, budget=40, **kw):
        return plan_micro_batches(b, budget, torch.device("cpu"), outputs_at="loss_mask", **kw)[1]

    assert all(mb.packed is not None for mb in plan(batch, share_prompts=True))
    assert all(mb.packed is None for mb in plan(batch))
    # one sample per prompt: nothing to share
    single = batch.select([row.samples[0] for row in group_by_prompt(batch, "loss_mask")])
    assert all(mb.packed is None for mb in plan(single, share_prompts=True))
    # a 2-token prompt before 37-token responses: one row of both saves 2 of 78 tokens, under MIN_SAVING
    ids = [torch.tensor([5, 6, *range(10, 47)]), torch.tensor([5, 6, *range(20, 57)])]
    long = SequenceBatch.from_lists(range(2), {"input_ids": ids,
                                               "loss_mask": [(torch.arange(39) >= 2).float()] * 2})
    assert 2 / 78 < MIN_SAVING and all(mb.packed is None for mb in plan(long, 100, share_prompts=True))
    ids[1][:20] = ids[0][:20]
    shared = SequenceBatch.from_lists(range(2), {"input_ids": ids, "loss_mask": [(torch.arange(39) >= 20).float()] * 2})
    assert all(mb.packed is not None for mb in plan(shared, 100, share_prompts=True))  # 20 of 78 saved


def test_the_packed_row_holds_every_sample_at_its_own_positions():
    batch = hand_batch()
    runs = split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(), 100)
    (mb,) = make_shared_micro_batches(batch, runs, torch.device("cpu"), outputs_at="loss_mask")
    assert mb.ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 4, 4, 5, 6, 9]]  # each prompt once
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2]]
    ids = mb.batch.token_fields["input_ids"]
    own_positions = torch.cat([torch.arange(n) for n in mb.batch.lengths.tolist()])
    assert torch.equal(mb.ids.flatten()[mb.token_index], ids)  # every sample's tokens, in order
    assert torch.equal(mb.positions.flatten()[mb.token_index], own_positions)
    # the wanted (response) tokens, predicted from the hidden state of the token before each
    assert torch.equal(mb.wanted_targets, ids[mb.wanted])
    assert torch.equal(mb.wanted_before, mb.token_index[mb.wanted - 1])
    assert mb.batch.token_fields["loss_mask"][mb.wanted].all() and len(mb.wanted) == 7
    assert mb.packed.cu_q.tolist() == [0, 3, 5, 6, 9, 11, 12] and mb.packed.max_q == 3
    assert mb.packed.cu_k.tolist() == [0, 3, 8, 12, 18, 20, 23] and mb.packed.max_k == 6


def test_packed_attention_equals_causal_attention_per_sample():
    """Each sample's tokens, taken out of the packed row, attend as in their own causal sequence;
    so do the gradients (a shared prompt's summed over its samples)."""
    batch = make_group_batch(128, prompts=3, samples=3, seed=4)
    runs = split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(), 1000)
    (mb,) = make_shared_micro_batches(batch, runs, torch.device("cpu"), outputs_at="loss_mask")
    g = torch.Generator().manual_seed(0)
    n = mb.ids.shape[1]
    qkv = [torch.randn(n, heads, 8, generator=g, requires_grad=True) for heads in (4, 2, 2)]
    weights = torch.randn(n, 4, 8, generator=g)
    out = packed_attention(*qkv, mb.packed)
    (out * weights).sum().backward()
    leaves = [t.detach().requires_grad_() for t in qkv]
    # a prompt's query rows recur in each of its samples here and once in the packed row: the
    # reference loss takes each copy at 1 / (number of copies)
    copies = torch.zeros(n).index_add_(0, mb.token_index, torch.ones(len(mb.token_index)))[:, None, None]
    assert copies.max() > 1  # the prompts' keys are gathered several times
    offsets = mb.batch.offsets.tolist()
    for s in range(len(mb.batch)):
        rows = mb.token_index[offsets[s]:offsets[s + 1]]
        q, k, v = (t[rows].transpose(0, 1) for t in leaves)
        own = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[rows], own, atol=1e-6, rtol=0)
        (own * weights[rows] / copies[rows]).sum().backward()
    for got, want in zip(qkv, leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=0)


def test_key_gather_sums_the_gradients_of_repeated_slots():
    """The gather's backward (first slots gathered, repeats added) against plain index_add."""
    # a prompt [0, 1] read by itself and by two samples [2, 3] and [4]
    kv_index = torch.tensor([0, 1, 0, 1, 2, 3, 0, 1, 4])
    seqs = PackedSequences.build(kv_index, [2, 2, 1], [2, 4, 3])
    assert seqs.keys.extra_slot.tolist() == [2, 3, 6, 7]
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(9, 2, 3, dtype=torch.float64)
    gather_keys(x, seqs).backward(grad)
    want = torch.zeros_like(x).index_add_(0, kv_index, grad)
    torch.testing.assert_close(x.grad, want, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="every packed token must be a key"):
        PackedSequences.build(torch.tensor([0, 0, 2]), [2, 1], [2, 1])


def packed_micro_batch(prompts: int, samples: int, seed: int):
    batch = make_group_batch(128, prompts=prompts, samples=samples, seed=seed)
    runs = split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(), 1000)
    (mb,) = make_shared_micro_batches(batch, runs, torch.device("cpu"), outputs_at="loss_mask")
    return mb


def test_rows_hold_each_sample_and_take_each_query_from_one_row():
    # a prompt [0, 1] read by itself and by two samples [2, 3] and [4]; a lone prompt [5]
    seqs = PackedSequences.build(torch.tensor([0, 1, 0, 1, 2, 3, 0, 1, 4, 5]), [2, 2, 1, 1], [2, 4, 3, 1])
    rows, L = seqs.rows, LENGTH_MULTIPLE
    # three rows of 4 keys, padded (token 0) to a multiple of LENGTH_MULTIPLE slots, and rows of
    # padding to a multiple of ROWS_MULTIPLE: attention meets few distinct shapes
    assert rows.length == L and rows.keys.index.view(-1, L).shape[0] == ROWS_MULTIPLE
    assert rows.keys.index.view(-1, L)[:3, :4].tolist() == [[0, 1, 2, 3], [0, 1, 4, 0], [5, 0, 0, 0]]
    assert rows.keys.index.view(-1, L)[:, 4:].eq(0).all() and rows.keys.index.view(-1, L)[3:].eq(0).all()
    # the prompt's queries ride in its first sample's row; every other query sits at its own key slot
    assert rows.query_slot.tolist() == [0, 1, 2, 3, L + 2, 2 * L]
    # every other slot's output is dropped: backward writes it a zero gradient
    assert sorted(rows.query_slot.tolist() + rows.dropped_slot.tolist()) == list(range(ROWS_MULTIPLE * L))
    # the keys' backward adds the prompt's second reading, not padding (which no real query sees)
    assert rows.keys.extra_slot.tolist() == [L, L + 1] and rows.keys.extra_token.tolist() == [0, 1]
    assert rows.pairs == ROWS_MULTIPLE * L * (L + 1) // 2 and seqs.pairs == 3 + 7 + 3 + 1
    assert seqs.kernel_on(torch.device("cpu"), 8) == "varlen"  # auto: no cuDNN or FlashAttention-4 kernel here
    # keys whose last slots are not the sequence's own queries have no rows
    assert PackedSequences.build(torch.tensor([0, 1, 2, 0, 1]), [2, 1], [2, 3]).rows is None
    with pytest.raises(ValueError, match="the rows kernel needs sequences whose last keys are their own queries"):
        PackedSequences.build(torch.tensor([0, 1, 2, 0, 1]), [2, 1], [2, 3], kernel="rows")
    with pytest.raises(ValueError, match="unknown packed attention kernel 'fast'"):
        PackedSequences.build(torch.arange(3), [3], [3], kernel="fast")


def test_fa4_kernel_without_its_package_is_refused_before_the_run(monkeypatch):
    """Choosing FlashAttention-4 where it is not installed fails when the settings are checked,
    naming the setting's value and the package, not at the first micro-batch."""
    monkeypatch.setattr(packed_attention_module, "fa4_available", lambda: False)
    with pytest.raises(ValueError, match="kernel 'fa4' needs FlashAttention-4"):
        PackedSequences.build(torch.arange(3), [3], [3], kernel="fa4")
    base = {"models": {"actor": {"path": "a"}}, "data": {"path": "d.jsonl"}, "generation": {"samples_per_prompt": 4}}
    with pytest.raises(ValueError, match="kernel 'fa4' needs FlashAttention-4"):
        check_config(load_config(None, ["algorithm.packed_attention=fa4"], base=base))
    check_config(load_config(None, ["algorithm.packed_attention=varlen"], base=base))  # the others need nothing


def test_rows_kernel_equals_the_masked_attention_with_its_gradients():
    """The rows kernel (samples of uneven lengths as padded rows, prompts' queries taken from a
    sample's row) gives the masked attention's outputs and gradients, float64."""
    seqs = packed_micro_batch(prompts=4, samples=3, seed=5).packed
    assert seqs.rows.keys.index.numel() > seqs.rows.query_slot.numel()  # padding and repeated prompts
    n = len(seqs.rows.query_slot)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(n, heads, 8, generator=g, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2)]
    weights = torch.randn(n, 4, 8, generator=g, dtype=torch.float64)
    (packed_attention(*qkv, seqs) * weights).sum().backward()
    leaves = [t.detach().requires_grad_() for t in qkv]
    out = attend_rows(*leaves, seqs.rows)
    (out * weights).sum().backward()
    torch.testing.assert_close(out, packed_attention(*qkv, seqs), rtol=1e-12, atol=1e-12)
    for got, want in zip(leaves, qkv):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


INFER_LAYOUTS = ["d1p1t1@0", "d1p2t2@0-3", "d2p1t1@0-1"]


@pytest.mark.parametrize("case,what", [("qwen3_qknorm", "logprobs"), ("llama_value", "values")])
def test_shared_inference_matches_transformers(pool, checkpoints, case, what):
    family = "qwen3" if case.startswith("qwen3") else "llama"
    path = checkpoints.get(case, family, tie_word_embeddings=family == "qwen3", value_head=what == "values")
    batch = make_group_batch(128)
    auto = transformers.AutoModelForSequenceClassification if what == "values" else transformers.AutoModelForCausalLM
    with torch.no_grad():
        ref = reference_outputs(auto.from_pretrained(path, dtype=torch.float32), batch, what == "values")[what]
    wanted = batch.token_fields["loss_mask"] > 0  # outputs elsewhere are 0 by design
    results = {}
    for part in pool.run(infer_job, path, INFER_LAYOUTS, batch, (what,), micro_batch_tokens=BUDGET,
                         temperature=1.0, outputs_at="loss_mask", share_prompts=True):
        results.update(part)
    for text in INFER_LAYOUTS:
        layout = Layout.parse(text)
        parts = []
        for d in range(layout.dp):
            ids, field = results[(text, what, layout.rank_at(layout.pp - 1, d, 0))]
            parts.append(SequenceBatch(ids, replica_share(batch, layout, layout.rank_at(0, d, 0)).lengths, {what: field}))
        got = SequenceBatch.concat(parts).sorted_by_id().token_fields[what]
        torch.testing.assert_close(got[wanted], ref[wanted], atol=2e-5, rtol=0, msg=f"{case} {text}")
        assert not got[~wanted].any()


def test_compiled_layers_run_packed_rows_alike(checkpoints):
    """The compiled decoder layers (one graph each side of the packed attention, no graph break)
    give the eager layers' outputs and parameter gradients, and micro-batches of other sizes do not
    make them compile again."""
    from torch._dynamo.utils import counters

    path = checkpoints.get("qwen3_qknorm", "qwen3", tie_word_embeddings=True)
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    layout = Layout((0,))
    batch = make_group_batch(128, seed=5)
    eager, _ = load_model(path, layout, world)
    compiled, _ = load_model(path, layout, world)
    assert compiled.compile_layers()
    breaks = sum(counters["graph_break"].values())
    run = lambda model, budget: infer(model, layout, world, batch, "logprobs", micro_batch_tokens=budget,  # noqa: E731
                                      outputs_at="loss_mask", share_prompts=True).token_fields["logprobs"]
    torch.testing.assert_close(run(compiled, BUDGET), run(eager, BUDGET), atol=1e-5, rtol=0)
    before = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(run(compiled, 60), run(eager, 60), atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == before

    (mb,) = make_shared_micro_batches(batch, split_rows(group_by_prompt(batch, "loss_mask"), batch.lengths.tolist(),
                                                        1000), torch.device("cpu"), outputs_at="loss_mask")

    def gradients(model):
        hidden = model(mb.ids, mb.positions, packed=mb.packed)
        (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    got, want = gradients(compiled), gradients(eager)
    assert got.keys() == want.keys() and any("q_proj" in name for name in got)
    for name in got:  # fp32 sums in another order (one element can cancel): each gradient as a whole
        error = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.parametrize("case", ["qwen3_qknorm", "mistral_window"])
def test_compiled_layers_run_padded_rows_of_any_count_alike(checkpoints, case):
    """Padded micro-batches (one row or several, their positions per row or shared, a sliding window
    shorter than the rows) run the compiled layers' two graphs, the same as packed ones: the eager
    layers' outputs and gradients, and no graph compiled beyond the trial's."""
    from torch._dynamo.utils import counters

    family = "mistral" if case == "mistral_window" else "qwen3"
    path = checkpoints.get(case, family, **({"tie_word_embeddings": True} if family == "qwen3" else {}))
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    eager, _ = load_model(path, Layout((0,)), world)
    compiled, _ = load_model(path, Layout((0,)), world)
    assert compiled.compile_layers()
    graphs = counters["stats"]["unique_graphs"]
    for rows, length, shared in [(2, 24, False), (3, 37, True), (1, 20, False)]:
        ids = torch.randint(0, 50, (rows, length), generator=torch.Generator().manual_seed(rows))
        positions = torch.arange(length)[None] if shared else torch.arange(length).expand(rows, length)
        weights = torch.randn(rows, length, eager.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
        outputs, grads = [], []
        for model in (compiled, eager):
            hidden = model(ids, positions)
            (hidden * weights).sum().backward()
            outputs.append(hidden.detach())
            grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0, msg=f"{rows} x {length}")
        assert grads[0].keys() == grads[1].keys() and any("q_proj" in name for name in grads[0])
        for name in grads[0]:
            error = ((grads[0][name] - grads[1][name]).norm() / grads[1][name].norm()).item()
            assert error < 1e-5, f"{rows} x {length} {name}: relative error {error:.2e}"
    assert counters["stats"]["unique_graphs"] == graphs
