"""Training steps under (pp, dp, tp) layouts, in padded rows and with shared prompts, against one
process running transformers and torch.optim.AdamW; gradient checkpointing; resume from
optimizer state."""

from __future__ import annotations

import pytest
import torch
from train_reference import TokenLoss, ValueLoss, assemble, make_batch, make_group_batch, reference_step, replica_share

from shardflow.config.experiment import OptimConfig
from shardflow.config.model import ModelConfig
from shardflow.engine.micro_batches import split_by_tokens
from shardflow.engine.train.engine import TrainEngine
from shardflow.models.checkpoint import load_model
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout

# eps is large on purpose: Adam's first update is lr * g / (|g| + eps). With a tiny eps that is
# lr * sign(g), blind to the gradient's size (a sync that doubled a gradient would pass), and
# elements with |g| near eps would amplify float32 rounding by lr / eps. With eps above most
# gradient elements (~1e-4..1e-2 here) the update follows g, and rounding is not amplified.
OPTIM = OptimConfig(lr=1e-2, eps=1e-2, weight_decay=0.1, grad_clip=0.5, schedule="cosine",
                    warmup_steps=2, total_steps=10)
BUDGET = 64  # padded tokens per micro-batch: several micro-batches per replica
BUCKET = 20_000  # small dp buckets, so that a step reduces several of them

CASES = {
    # 4 heads, 2 KV heads: tp=4 replicates KV heads; pp=4 puts one layer on each stage.
    # +gc: gradient checkpointing; +zero: the optimizer state sharded over dp, gradients
    # reduce-scattered; +offload: the optimizer state in host memory, streamed in chunks
    "llama": (dict(family="llama"), ["d1p1t1@0", "d1p2t1@0-1", "d2p1t1@0-1", "d1p1t2@0-1", "d1p1t4@0-3",
                                     "d2p2t2@0-7", "d1p4t2@0-7", "d1p2t2@0-3+gc", "d2p1t1@0-1+zero",
                                     "d4p1t1@0-3+zero", "d4p1t2@0-7+zero", "d2p2t2@0-7+gc+zero",
                                     "d1p1t1@0+offload", "d2p1t2@0-3+zero+offload"]),
    # q/k norms (partial gradients over tp) and a tied embedding split over pipeline stages.
    "qwen3_qknorm": (dict(family="qwen3", tie_word_embeddings=True), ["d1p2t2@0-3", "d2p2t1@0-3", "d1p1t4@0-3",
                                                                      "d2p2t1@0-3+zero",
                                                                      "d2p1t2@0-3+zero"]),
    # q/k/v biases (replicated KV heads' biases are partial too) and a vocabulary padded for tp=4.
    "qwen2_bias": (dict(family="qwen2", vocab_size=130), ["d1p1t4@0-3", "d2p2t2@0-7", "d2p1t4@0-7+zero"]),
    "llama_value": (dict(family="llama", value_head=True), ["d1p2t2@0-3", "d2p1t1@0-1"]),
}


def train_job(world, path: str, runs: list[str], batch, value_head: bool, budget: int = BUDGET,
              share_prompts: bool = False):
    """One step per run (a layout, ``+gc`` for gradient checkpointing, ``+zero`` for the sharded
    optimizer, ``+offload`` for its state in host memory) on the ranks of its layout."""
    layouts = [run_layout(r) for r in runs]
    world.create_groups(layouts)
    out = {}
    for run, layout in zip(runs, layouts):
        if world.rank not in layout:
            continue
        model, _ = load_model(path, layout, world)
        engine = TrainEngine(model, layout, world, OPTIM, gradient_checkpointing="+gc" in run,
                             bucket_numel=BUCKET, shard_optimizer="+zero" in run, offload_optimizer="+offload" in run)
        if "+offload" in run:
            engine.optimizer.chunk_numel = 7_000  # several chunks, cut inside parameters
        loss = ValueLoss() if value_head else TokenLoss()
        metrics = engine.step(replica_share(batch, layout, world.rank), loss, micro_batch_tokens=budget,
                              share_prompts=share_prompts)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: g.clone() for n, g in engine.gradients().items()}  # after clipping
        out[run] = (weights, grads, metrics)
    return out


def run_layout(run: str) -> Layout:
    return Layout.parse(run.split("+")[0])


# float32 everywhere. Layouts change summation orders (tp splits of matrix products, micro-batch
# and dp sums of gradients), which moves gradients by a few float32 ulps of the largest partial
# sums (|g| <= ~0.05 here): 1e-7 absolute. An update lr * g / (|g| + eps) changes by at most
# lr / eps = 1 times that, on weights of size ~0.3.
GRAD_ATOL = 1e-7
WEIGHT_ATOL = 2e-7


# Shared prompts (engine.shared_prompts): prompts with several samples each, packed rows.
SHARED_RUNS = {"llama": ["d1p1t1@0", "d1p2t2@0-3", "d2p1t1@0-1", "d1p2t1@0-1+gc"],
               "qwen3_qknorm": ["d1p1t2@0-1"], "llama_value": ["d1p2t2@0-3"]}
SHARED_BUDGET = 40  # packed tokens per micro-batch: prompts with four samples need two rows


@pytest.mark.parametrize("case,shared", [(c, False) for c in CASES] + [(c, True) for c in SHARED_RUNS])
def test_train_step_matches_single_process(pool, checkpoints, case, shared):
    kwargs, runs = CASES[case]
    kwargs = dict(kwargs)
    path = checkpoints.get(case, kwargs.pop("family"), **kwargs)
    cfg = ModelConfig.from_pretrained(path)
    batch = (make_group_batch if shared else make_batch)(cfg.vocab_size)
    runs, budget = (SHARED_RUNS[case], SHARED_BUDGET) if shared else (runs, BUDGET)
    loss = ValueLoss() if cfg.value_head else TokenLoss()
    ref_weights, ref_grads, ref_metrics = reference_step(path, batch, loss, OPTIM, cfg.value_head)
    assert ref_metrics["grad_norm"] > OPTIM.grad_clip  # clipping is exercised

    results = pool.run(train_job, path, runs, batch, cfg.value_head, budget, shared)
    for run in runs:
        layout = run_layout(run)
        weights = assemble(cfg, layout, {r: res[run][0] for r, res in enumerate(results) if run in res})
        grads = assemble(cfg, layout, {r: res[run][1] for r, res in enumerate(results) if run in res})
        assert sorted(weights) == sorted(ref_weights)
        for name in ref_weights:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=GRAD_ATOL, rtol=0, msg=f"{run} grad {name}")
            torch.testing.assert_close(weights[name], ref_weights[name], atol=WEIGHT_ATOL, rtol=0,
                                       msg=f"{run} weight {name}")
        for rank, res in enumerate(results):
            if run not in res:
                continue
            metrics = res[run][2]
            assert metrics["lr"] == pytest.approx(OPTIM.lr / 2) and metrics["skipped"] == 0.0
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-6)
            if layout.coord(rank).pp == layout.pp - 1:
                assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-6, abs=1e-7), run
            else:
                assert "loss" not in metrics
            if shared:  # the samples did share rows: fewer tokens than padded rows of the same budget
                lengths = replica_share(batch, layout, rank).lengths.tolist()
                padded = sum(len(g) * max(lengths[i] for i in g)
                             for g in split_by_tokens(lengths, budget, min_micro_batches=layout.pp))
                assert metrics["model_tokens"] < 0.8 * padded, run


def test_gradient_checkpointing_gives_the_same_gradients(pool, checkpoints):
    path = checkpoints.get("llama", "llama")
    batch = make_batch(128)
    runs = ["d1p2t2@0-3", "d1p2t2@0-3+gc"]
    results = pool.run(train_job, path, runs, batch, False)
    for rank in range(4):
        plain, recomputed = results[rank][runs[0]], results[rank][runs[1]]
        for name, g in plain[1].items():
            assert torch.equal(g, recomputed[1][name]), name  # the same operations, recomputed


def resume_job(world, path: str, layout_text: str, other_text: str, batches, saved: str, sharded: bool,
               offloaded: bool = False):
    """Engine A takes a step and saves its state by tensor name, then takes a second step. Engine
    B (A's layout) loads the state and takes the second step: both must end bit for bit equal.
    Engine C, in another layout, loads the same state: its slices are returned for assembly."""
    layout, other = Layout.parse(layout_text), Layout.parse(other_text)
    world.create_groups([layout, other])
    loss = TokenLoss()

    def engine(where):
        model, _ = load_model(path, where, world)
        return model, TrainEngine(model, where, world, OPTIM, bucket_numel=BUCKET, shard_optimizer=sharded,
                                  offload_optimizer=offloaded)

    out = {}
    if world.rank in layout:
        model_a, a = engine(layout)
        a.step(replica_share(batches[0], layout, world.rank), loss, micro_batch_tokens=BUDGET)
        a.save_state(saved)
        out["a"] = pieces(a)
    world.barrier()
    if world.rank in layout:
        metrics_a = a.step(replica_share(batches[1], layout, world.rank), loss, micro_batch_tokens=BUDGET)
        model_b, b = engine(layout)
        b.load_state(saved)
        metrics_b = b.step(replica_share(batches[1], layout, world.rank), loss, micro_batch_tokens=BUDGET)
        same = all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
        same &= all(torch.equal(x, y) for x, y in zip(
            (a.optimizer.master, a.optimizer.exp_avg, a.optimizer.exp_avg_sq),
            (b.optimizer.master, b.optimizer.exp_avg, b.optimizer.exp_avg_sq)))
        out["resumed"] = (same, metrics_a, metrics_b, a.step_count, b.step_count)
    if world.rank in other:
        model_c, c = engine(other)
        c.load_state(saved)
        out["c"] = pieces(c)
        master = c._state_views()["master"]
        out["c_weights_are_master"] = all(torch.equal(p.float(), master[n]) for n, p in zip(c.grads.names, c._params))
    return out


def pieces(engine) -> dict:
    """The engine's optimizer state as (full shape, where in the full tensor, values) per name."""
    shard = engine.shard.tensors
    return {kind: {n: (shard[n].full_shape, shard[n].full_slices(), t[shard[n].local_slices()].clone())
                   for n, t in views.items()} for kind, views in engine._state_views().items()}


def assembled(parts: list[dict]) -> dict:
    """Full tensors from the ranks' pieces."""
    full: dict = {}
    for part in parts:
        for kind, tensors in part.items():
            for name, (shape, where, values) in tensors.items():
                full.setdefault(kind, {}).setdefault(name, torch.full(shape, float("nan")))[where] = values
    return full


@pytest.mark.parametrize("sharded,offloaded", [(False, False), (True, False), (True, True)])
def test_resume_from_optimizer_state_by_name_under_the_same_and_another_layout(pool, checkpoints, tmp_path, sharded,
                                                                               offloaded):
    path = checkpoints.get("llama", "llama")
    batches = [make_batch(128, seed=1), make_batch(128, seed=2)]
    other = "d2p1t2@4-7" if sharded else "d1p2t2@4-7"
    results = pool.run(resume_job, path, "d2p2t1@0-3", other, batches, str(tmp_path / "state"), sharded, offloaded)
    resumed = [r["resumed"] for r in results if "resumed" in r]
    assert len(resumed) == 4
    for same, metrics_a, metrics_b, steps_a, steps_b in resumed:
        assert same and metrics_a == metrics_b and steps_a == steps_b == 2
        assert metrics_a["lr"] == pytest.approx(OPTIM.lr)  # second warmup step: full rate
    # the other layout holds exactly the saved state, sliced its own way, and its weights are set from it
    before, loaded = assembled([r["a"] for r in results if "a" in r]), assembled([r["c"] for r in results if "c" in r])
    assert before.keys() == loaded.keys() == {"master", "exp_avg", "exp_avg_sq"}
    for kind in before:
        assert before[kind].keys() == loaded[kind].keys()
        for name, tensor in before[kind].items():
            assert not tensor.isnan().any() and torch.equal(tensor, loaded[kind][name]), (kind, name)
    assert all(r["c_weights_are_master"] for r in results if "c" in r)
    # what is on disk: safetensors and JSON, nothing pickled
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["exp_avg", "exp_avg_sq", "master",
                                                                      "optimizer.json"]
    assert not list((tmp_path / "state").rglob("*.pt")) and not list((tmp_path / "state").rglob("*.pkl"))


def count_job(world, path: str, layout_text: str, batch, sharded: bool = False):
    layout = Layout.parse(layout_text)
    world.create_groups([layout])
    if world.rank not in layout:
        return None
    model, shard = load_model(path, layout, world)
    engine = TrainEngine(model, layout, world, OPTIM, bucket_numel=BUCKET, shard_optimizer=sharded)
    with comm.count_collectives() as counts:
        metrics = engine.step(replica_share(batch, layout, world.rank), TokenLoss(), micro_batch_tokens=BUDGET)
    return dict(counts), len(engine.grads.buckets), int(metrics["num_micro_batches"]), shard.last_stage


def test_collectives_of_a_step(pool, checkpoints):
    """pp=2 x dp=2 (no tp): per micro-batch one activation and one gradient cross the stage
    boundary; all-reduces: normalizer, each gradient bucket, stats (last stage), norm."""
    results = pool.run(count_job, checkpoints.get("llama", "llama"), "d2p2t1@0-3", make_batch(128))
    for counts, buckets, micro, last in filter(None, results):
        assert buckets > 1 and micro > 1
        assert counts == {"all_reduce": 1 + buckets + int(last) + 1, "isend": micro, "irecv": micro}


def test_collectives_of_a_sharded_step(pool, checkpoints):
    """Sharded optimizer, pp=2 x dp=2 of a model whose embedding is tied across the stages: each
    bucket of the other tensors is reduce-scattered, the tied copies' buckets are all-reduced whole
    (then exchanged between the stages), and the updated weights are all-gathered once."""
    results = pool.run(count_job, checkpoints.get("qwen3_qknorm", "qwen3", tie_word_embeddings=True),
                       "d2p2t1@0-3", make_batch(128), True)
    for counts, buckets, micro, last in filter(None, results):
        scattered = counts["reduce_scatter"]
        assert scattered >= 2 and counts["all_gather"] == 1
        # all-reduces: normalizer, the tied copy's bucket(s), stats (last stage), norm
        assert counts["all_reduce"] == 1 + (buckets - scattered) + int(last) + 1 and buckets - scattered >= 1
        assert counts["isend"] == counts["irecv"] == micro + 1  # + the tied gradients' exchange


def bytes_job(world, path: str, layout_text: str):
    layout = Layout.parse(layout_text)
    world.create_groups([layout])
    if world.rank not in layout:
        return None
    sizes = []
    for sharded in (False, True):
        model, _ = load_model(path, layout, world)
        engine = TrainEngine(model, layout, world, OPTIM, bucket_numel=BUCKET, shard_optimizer=sharded)
        sizes.append(engine.optimizer_bytes())
        engine.close()
    return sizes, len(engine.grads.buckets)


@pytest.mark.parametrize("layout", ["d2p1t1@0-1", "d4p1t1@0-3", "d4p1t2@0-7"])
def test_the_sharded_optimizer_holds_one_dp_th_of_the_state(pool, checkpoints, layout):
    """Measured from the tensors: the master weights and moments per rank are 1/dp of the unsharded
    ones, plus less than one element of padding per bucket (each bucket is padded to a multiple of dp)."""
    dp = Layout.parse(layout).dp
    for out in pool.run(bytes_job, checkpoints.get("llama", "llama"), layout):
        if out is not None:
            (whole, part), buckets = out
            assert whole / dp <= part < whole / dp + 3 * 4 * buckets, (whole, part)
