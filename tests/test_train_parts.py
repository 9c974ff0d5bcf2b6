"""Pieces of the training engine on one process: micro-batch splitting and budgets, learning-rate schedules,
AdamW against torch.optim.AdamW, the entropy gradient, and float32 master weights of a bf16 model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_cases import tiny
from train_reference import TokenLoss, make_batch

from shardflow.config.experiment import OptimConfig
from shardflow.data.batch import SequenceBatch
from shardflow.engine.micro_batches import make_micro_batches, padded_width, split_by_tokens
from shardflow.engine.outputs import token_outputs
from shardflow.engine.train.engine import TrainEngine
from shardflow.engine.train.optimizer import AdamW, check_schedule, lr_at
from shardflow.models.checkpoint import load_model
from shardflow.models.token_stats import head_logprobs_and_entropy
from shardflow.parallel.layout import Layout
from shardflow.parallel.world import World
from shardflow.profiler.measure import one_layer_model
from shardflow.runtime.calls.budget import CPU_TOKENS, smallest_over, token_budget

# ----- micro-batches -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=40), budget=st.integers(50, 400), least=st.integers(1, 6))
def test_micro_batches_cover_every_sequence_once_within_budget(lengths, budget, least):
    parts = split_by_tokens(lengths, budget, min_micro_batches=least)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p and len(p) * max(lengths[i] for i in p) <= budget for p in parts)
    assert len(parts) >= min(least, len(lengths))
    assert parts == split_by_tokens(list(lengths), budget, min_micro_batches=least)  # deterministic
    if least == 1:  # sorted, maximal runs: no two neighbours could merge within the budget
        for a, b in zip(parts, parts[1:]):
            assert (len(a) + len(b)) * max(lengths[i] for i in a + b) > budget


def test_micro_batches_sort_by_length_for_tight_padding():
    assert split_by_tokens([5, 9, 3, 9, 2, 7], 20) == [[1, 3], [5, 0], [2, 4]]
    assert split_by_tokens(torch.tensor([4, 4, 4]), 8, min_micro_batches=3) == [[0], [1], [2]]


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 150), min_size=1, max_size=30), budget=st.integers(150, 600),
       pad=st.sampled_from([8, 64]))
def test_micro_batches_padded_to_a_multiple_stay_within_budget(lengths, budget, pad):
    """Rows padded to a multiple (GPUs: few attention shapes) count their padding in the budget."""
    parts = split_by_tokens(lengths, budget, pad_multiple=pad)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for part in parts:
        longest = max(lengths[i] for i in part)
        width = padded_width(longest, pad, budget)
        assert len(part) * width <= budget and longest <= width
        assert width % pad == 0 or width == budget


def test_rows_padded_to_a_multiple_give_the_same_outputs():
    """A micro-batch padded past its longest sequence: every token's log-probability unchanged."""
    cfg = tiny("qwen3", tie_word_embeddings=True)
    model = one_layer_model(cfg, 1, torch.device("cpu"), torch.float32)
    batch = make_batch(cfg.vocab_size, num=5, seed=2)
    groups = split_by_tokens(batch.lengths, 200)
    outputs = []
    for pad in (1, 64):
        mb = make_micro_batches(batch, groups, torch.device("cpu"), outputs_at="loss_mask", pad_multiple=pad,
                                max_tokens=200)[0]
        assert mb.ids.shape[1] == (int(batch.lengths[groups[0]].max()) if pad == 1 else 64)
        with torch.no_grad():
            outputs.append(token_outputs(model, model(mb.ids, mb.positions), mb, ("logprobs",))["logprobs"])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def test_micro_batch_budget_below_a_sequence_is_named():
    with pytest.raises(ValueError, match="sequence 1 has 30 tokens, more than the micro-batch budget of 20"):
        split_by_tokens([10, 30], 20)


# ----- learning-rate schedules -----------------------------------------------------------------


def test_call_budget_takes_the_plan_then_the_setting_then_the_device():
    """The runtime's budget per call (``runtime.calls.budget``): a plan's micro-batch count first,
    then ``algorithm.micro_batch_tokens``; unset on CPU ranks, the fixed CPU budget; never below the
    longest sequence."""
    batch = SequenceBatch.from_lists(range(3), {"input_ids": [torch.ones(n, dtype=torch.long) for n in (900, 50, 10)]})

    def ctx(plan_count, setting):
        algo = SimpleNamespace(micro_batch_tokens=setting)
        return SimpleNamespace(micro_batches=plan_count, config=SimpleNamespace(algorithm=algo),
                               world=SimpleNamespace(device=torch.device("cpu")))

    assert token_budget(ctx(2, 64), batch, training=True) == 900  # half of 960 tokens, but the longest is 900
    assert token_budget(ctx(None, 2000), batch, training=True) == 2000
    assert token_budget(ctx(None, 64), batch, training=False) == 900
    assert token_budget(ctx(None, None), batch, training=True) == CPU_TOKENS
    long = SequenceBatch.from_lists(range(1), {"input_ids": [torch.ones(CPU_TOKENS + 5, dtype=torch.long)]})
    assert token_budget(ctx(None, None), long, training=False) == CPU_TOKENS + 5


def _smallest_budget_job(world, proposals):
    layout = Layout.contiguous(pp=2, tp=2)  # ranks 0-3: two stages of two tp shards
    world.create_groups([layout])
    if world.rank not in layout:
        return smallest_over(world, Layout((world.rank,)), proposals[world.rank])  # alone: its own
    return smallest_over(world, layout, proposals[world.rank])


def test_the_ranks_of_a_layout_agree_on_the_smallest_budget(pool):
    proposals = [30720, 8192, 20480, 32768, 1024, 2048, 3072, 4096]
    assert pool.run(_smallest_budget_job, proposals) == [8192] * 4 + proposals[4:]


def test_lr_schedules_match_hand_computed_values():
    const = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_at(const, s) for s in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    lin = OptimConfig(lr=2.0, schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # after warmup: 2 * (0.1 + 0.9 * (1 - (s - 2) / 4))
    assert [lr_at(lin, s) for s in range(1, 9)] == pytest.approx([1.0, 2.0, 1.55, 1.1, 0.65, 0.2, 0.2, 0.2])
    cos = OptimConfig(lr=1.0, schedule="cosine", total_steps=4)
    # 0.5 * (1 + cos(pi * s / 4))
    assert [lr_at(cos, s) for s in range(1, 5)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ValueError, match="lr schedule 'cosine' needs total_steps greater than warmup_steps"):
        check_schedule(OptimConfig(schedule="cosine", warmup_steps=10, total_steps=5))
    with pytest.raises(ValueError, match="schedule must be one of constant, linear, cosine; got 'step'"):
        OptimConfig(schedule="step")
    with pytest.raises(ValueError, match="lr must be positive, got 0"):
        OptimConfig(lr=0)


# ----- AdamW -----------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
def test_flat_adamw_matches_torch_adamw(offload):
    """On the device and offloaded (the state in chunks of 8 elements, cut inside the decayed
    matrix), the update of torch's fused AdamW, bit for bit."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g), torch.randn(7, generator=g)
    cfg = OptimConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.3)
    ours = AdamW(torch.cat([a.flatten(), b]), [(0, 30)], cfg, offload=offload, chunk_numel=8)  # decay: the matrix
    master = torch.zeros(37)
    pa, pb = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    theirs = torch.optim.AdamW([{"params": [pa], "weight_decay": 0.3}, {"params": [pb], "weight_decay": 0.0}],
                               lr=1e-2, betas=(0.8, 0.95), eps=1e-6, fused=True)
    for step in range(1, 5):
        ga, gb = torch.randn(6, 5, generator=g), torch.randn(7, generator=g)
        ours.step(torch.cat([ga.flatten(), gb]), 1e-2, step, lambda lo, hi, values: master[lo:hi].copy_(values))
        pa.grad, pb.grad = ga, gb
        theirs.step()
    torch.testing.assert_close(master, torch.cat([pa.detach().flatten(), pb.detach()]), atol=0, rtol=0)
    torch.testing.assert_close(ours.master, master, atol=0, rtol=0)


# ----- entropy gradient ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1 << 20, 15 * 4])
def test_logprob_and_entropy_values_and_gradients_match_autograd(temperature, chunk_elements):
    """The head in one chunk, and in chunks of 4 vocabulary columns (15 rows): one chunk holds the
    first padding row, the last one nothing but padding. Against float64 log-softmax of the whole
    logits, values and the gradients of both the hidden states and the head weight."""
    hidden, weight = torch.randn(3, 5, 16), torch.randn(13, 16)  # rows 11 and 12: vocabulary padding
    targets = torch.randint(0, 11, (3, 5))
    w_lp, w_h = torch.randn(3, 5), torch.randn(3, 5)
    h1, v1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, h = head_logprobs_and_entropy(h1, v1, targets, 0, 11, None, temperature=temperature,
                                      chunk_elements=chunk_elements)
    (lp * w_lp + h * w_h).sum().backward()
    h2, v2 = hidden.double().requires_grad_(), weight[:11].double().requires_grad_()  # float64 reference
    logp = torch.log_softmax(h2 @ v2.T / temperature, -1)
    lp2, ent2 = logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)
    (lp2 * w_lp.double() + ent2 * w_h.double()).sum().backward()
    # the engine works in float32: rounding of terms of size ~1-10
    torch.testing.assert_close(lp, lp2.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(h, ent2.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(h1.grad, h2.grad.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(v1.grad[:11], v2.grad.float(), atol=2e-5, rtol=0)
    assert not v1.grad[11:].any()


# ----- bf16 model, float32 master weights ------------------------------------------------------


def test_bf16_model_keeps_float32_master_weights(checkpoints):
    """Adam's first update is lr * g / (|g| + eps) (moments equal g and g^2 after bias
    correction). With lr far below bf16 resolution the bf16 weights barely move, while the
    float32 master weights take exactly that update."""
    path = checkpoints.get("llama", "llama")
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")  # one rank: no groups
    layout = Layout((0,))
    model, _ = load_model(path, layout, world, dtype=torch.bfloat16)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    cfg = OptimConfig(lr=1e-5, eps=1e-6, grad_clip=0.0)
    engine = TrainEngine(model, layout, world, cfg)
    metrics = engine.step(make_batch(128), TokenLoss(), micro_batch_tokens=100)
    assert math.isfinite(metrics["loss"]) and metrics["skipped"] == 0.0
    assert engine.optimizer.master.dtype == torch.float32
    unchanged = total = 0
    masters, grads = engine._kind_views("master"), engine.gradients()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        master = masters[name]
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), name
        grad = grads[name]
        expected = before[name] - cfg.lr * grad / (grad.abs() + cfg.eps)
        # float32 rounding of master weights of size <= ~0.5: 3e-8
        torch.testing.assert_close(master, expected, atol=3e-8, rtol=0, msg=name)
        unchanged += int((p.detach().float() == before[name]).sum())
        total += p.numel()
    assert unchanged > 0.9 * total  # bf16 alone would have lost nearly every update


def test_bad_step_input_is_named(checkpoints):
    world = World(rank=0, size=1, device=torch.device("cpu"), backend="gloo")
    layout = Layout((0,))
    model, _ = load_model(checkpoints.get("llama", "llama"), layout, world)
    with pytest.raises(ValueError, match="built for rank 0 of d1p1t1@0, not rank 0 of d1p1t1@1"):
        TrainEngine(model, Layout((1,)), world, OptimConfig())
    engine = TrainEngine(model, layout, world, OptimConfig())
    batch = make_batch(128)
    with pytest.raises(ValueError, match="empty batch"):
        engine.step(batch.select([]), TokenLoss(), micro_batch_tokens=64)
    with pytest.raises(ValueError, match="lacks token field 'input_ids'"):
        engine.step(SequenceBatch(batch.sample_ids, batch.lengths), TokenLoss(), micro_batch_tokens=64)
    with pytest.raises(ValueError, match="more than the micro-batch budget of 8 tokens"):
        engine.step(batch, TokenLoss(), micro_batch_tokens=8)
    no_response = batch.update({"loss_mask": torch.zeros(batch.num_tokens)})
    with pytest.raises(ValueError, match="loss normalizer summed over replicas is 0.0"):
        engine.step(no_response, TokenLoss(), micro_batch_tokens=64)
    assert engine.step_count == 0
