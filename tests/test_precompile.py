"""The decode step compiled ahead in a helper process (``engine.generate.precompile``): what it
compiles lands in the compile cache where the run's own compilation of the same steps finds it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from gen_helpers import prompts

from shardflow.config.load import load_config
from shardflow.config.model import ModelConfig
from shardflow.engine.compile_cache import graph_cache_counts, use_compile_cache
from shardflow.engine.generate import precompile, precompile_launch
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.requests import SamplingParams, make_requests
from shardflow.models.tiny import tiny_hf_config
from shardflow.models.transformer import build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for
from shardflow.parallel.world import World
from shardflow.runtime.calls.generate import precompile_job

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


def tiny_job(**engine) -> precompile.Job:
    cfg = ModelConfig.from_hf_dict(tiny_hf_config("qwen3", tie_word_embeddings=True).to_dict())
    config = EngineConfig(max_seq_len=48, max_batch_size=8, compile=True, kv_block_size=16, **engine)
    return precompile.Job(cfg=cfg, shard=shard_for(cfg, Layout((0,)), 0), engine=config, device="cpu",
                          dtype=torch.float32, batch=6, modes=("greedy",), shared=True, varying=False)


def test_the_run_compiles_from_the_cache_that_the_helper_filled(tmp_path, monkeypatch):
    """The helper's model has other weights, fewer layers and a smaller KV cache than the run's:
    none of it is part of what the compile cache keys, so the run's compilation of its first steps
    (two samples of three prompts, sharing their prompts' blocks) builds no graph; its tokens are
    the eager engine's."""
    job = tiny_job()
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        assert precompile_launch.prestart(force=True)  # as ``shardflow train`` does before its imports
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "precompile.ready").touch()  # an earlier run's: not this helper's
        use_compile_cache(str(tmp_path / "cache"))  # as the run does before it hands the helper its jobs
        helper = precompile_launch.start([job], str(tmp_path / "cache"), tmp_path / "logs" / "precompile.log")
        helper.wait_ready()
        assert "compiled the first decode steps" in (tmp_path / "logs" / "precompile.log").read_text()

        torch.manual_seed(0)
        model = build_model(job.cfg, job.shard, None, "cpu", torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        eager = GenerationEngine(model, dataclasses.replace(job.engine, compile=False))
        expected = [r.output_ids for r in eager.generate(make_requests(prompts(lengths=(20, 17, 21)), GREEDY, 2))]
        torch._dynamo.reset()
        hits, misses = graph_cache_counts()
        engine = GenerationEngine(model, job.engine)
        got = [r.output_ids for r in engine.generate(make_requests(prompts(lengths=(20, 17, 21)), GREEDY, 2))]
        cached, built = (after - before for after, before in zip(graph_cache_counts(), (hits, misses)))
        torch._dynamo.reset()
        assert helper.process.wait(60) == 0, (tmp_path / "logs" / "precompile.log").read_text()
        helper.finish()
    assert got == expected
    assert (cached, built) == (4, 0)  # the layer, the step's start and end, the sampler's pick


def test_the_steps_compiled_are_those_of_the_first_batch_and_of_a_shrinking_one():
    job = tiny_job()
    model = build_model(job.cfg, job.shard, None, "cpu", torch.float32)
    engine = GenerationEngine(model, job.engine)
    warmed = []
    engine.decode.warm = lambda n, key: warmed.append((n, key))
    engine.compile_step(6, ["sample", "greedy"], shared=True)
    assert warmed == [(6, ("sample", True)), (6, ("greedy", True))]
    assert engine.step_batches(6, varying=False) == [6]  # no graphs: no padding
    assert engine.step_batches(6, varying=True) == [6, 3, 1]  # dynamic batch, then one row
    engine.decode.pad = True  # as with CUDA graphs: batches padded to their bucket of 2, 4, 8 rows
    assert engine.step_batches(6, varying=False) == [8]
    assert engine.step_batches(8, varying=True) == [8, 4]  # one row runs in the bucket of two
    assert engine.step_batches(3, varying=True) == [4, 2]
    assert engine.step_batches(2, varying=True) == [2]
    assert engine.step_batches(1, varying=True) == [2]
    assert engine.step_batches(100, varying=False) == [8]  # at most the engine's slots
    plain = GenerationEngine(model, dataclasses.replace(job.engine, compile=False))
    assert plain.step_batches(8) == []


def test_the_helper_takes_a_layer_per_window_and_a_cache_of_few_blocks():
    job = tiny_job()
    cfg = dataclasses.replace(job.cfg, num_layers=5, sliding_windows=(None, 16, None, 16, 32))
    assert precompile._layer_per_window(cfg, range(5)) == (0, 1, 4)
    shard = dataclasses.replace(job.shard, layers=(0,))
    per_block = 2 * job.cfg.num_kv_heads * job.cfg.head_dim * 4 * 16
    assert precompile._small_cache(job, shard) == (3 + 1 + 1) * per_block  # 47 positions: 3 blocks a slot
    # a block count equal to the block size (the scratch block's included) would be one size to dynamo
    long = dataclasses.replace(job, engine=dataclasses.replace(job.engine, max_seq_len=16 * 14 + 1))
    assert precompile._small_cache(long, shard) == (14 + 2 + 1) * per_block
    contiguous = dataclasses.replace(job, engine=dataclasses.replace(job.engine, kv_block_size=None))
    assert precompile._small_cache(contiguous, shard) == (8 + 2) * per_block // 16 * 47


def test_a_helper_with_no_jobs_goes_away():
    assert precompile_launch.prestart(force=True)
    assert not precompile_launch.prestart(force=True)  # one at a time
    waiting, jobs = precompile_launch._waiting
    assert precompile_launch.start([], "", Path("unused")) is None
    assert waiting.wait(60) == 0
    assert not jobs.exists() and not jobs.with_suffix(".log").exists()  # it leaves nothing behind


def test_a_failing_or_slow_helper_costs_a_warning(tmp_path, caplog):
    log = tmp_path / "precompile.log"
    assert precompile_launch.start([tiny_job()], "", log) is None  # no helper waits: the run compiles for itself
    assert precompile_launch.prestart(force=True)
    precompile_launch._waiting[0].kill()
    precompile_launch._waiting[0].wait()
    with caplog.at_level(logging.WARNING):
        assert precompile_launch.start([tiny_job()], "", log) is None
    assert "the precompile helper ended before its jobs came" in caplog.text
    caplog.clear()
    assert precompile_launch.prestart(force=True)
    with caplog.at_level(logging.WARNING):
        failing = precompile_launch.start([dataclasses.replace(tiny_job(), device="cuda:7")], "", log)
        failing.wait_ready()
        failing.finish()
    assert failing.process.returncode != 0 and "Error" in log.read_text()
    assert f"compiling the decode step ahead failed (exit code {failing.process.returncode}" in caplog.text
    assert str(log) in caplog.text
    caplog.clear()
    # a helper that started a worker of its own: stopping it stops both
    slow = precompile_launch.Helper(subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, start_new_session=True), log)
    assert slow.process.stdout.readline() == b"started\n"
    with caplog.at_level(logging.WARNING):
        slow.wait_ready(timeout=0.5)
    assert slow.process.poll() is not None
    assert not group_alive(slow.process.pid)  # the worker with it
    assert "ran past 0 s and was stopped" in caplog.text


def group_alive(pgid: int, seconds: float = 10.0) -> bool:
    """Whether a process of the group is still there after ``seconds`` (the orphans' reaper is quick)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def test_jobs_of_one_engine_merge_their_modes():
    job = tiny_job()
    greedy, sample = job, dataclasses.replace(job, modes=("sample",))
    other = dataclasses.replace(job, batch=4)
    assert precompile.merged([greedy, sample, other, sample]) == [
        dataclasses.replace(job, modes=("greedy", "sample")), other]


@pytest.fixture
def gpu_config(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"models": {"actor": {"path": "m"}}, "data": {"path": "d.jsonl"},
                                    "generation": {"samples_per_prompt": 4}, "algorithm": {"batch_size": 6}}))
    return path


def test_the_first_rank_of_a_compiled_layout_compiles_ahead(gpu_config):
    """The job is the engine's: decided from the settings alone (no device is touched)."""
    cfg = tiny_job().cfg
    config = load_config(gpu_config)
    cuda = torch.device("cuda", 0)
    layout = Layout((0, 1), dp=2)
    job = precompile_job(config, layout, cfg, World(rank=0, size=2, device=cuda, backend="nccl"), torch.bfloat16,
                         greedy=False)
    assert (job.batch, job.modes, job.shared, job.varying) == (12, ("sample",), True, True)  # 3 prompts x 4
    assert job.engine.compile and job.shard.layers == tuple(range(cfg.num_layers)) and job.device == "cuda:0"
    greedy = precompile_job(load_config(gpu_config, ["generation.force_length=true"]), layout, cfg,
                            World(rank=0, size=2, device=cuda, backend="nccl"), torch.bfloat16, greedy=True)
    assert (greedy.modes, greedy.varying) == (("greedy",), False)
    for config, layout, rank, device in [
        (config, layout, 1, cuda),  # the layout's first rank compiles for it
        (config, Layout((0, 1), tp=2), 0, cuda),  # tp > 1 does not compile
        (config, layout, 0, torch.device("cpu")),
        (load_config(gpu_config, ["generation.compile_ahead=false"]), layout, 0, cuda),
        (load_config(gpu_config, ["generation.compile=false"]), layout, 0, cuda),
    ]:
        world = World(rank=rank, size=2, device=device, backend="nccl")
        assert precompile_job(config, layout, cfg, world, torch.bfloat16, greedy=False) is None


def test_a_run_hands_its_helper_the_first_steps_and_stops_it_after_its_first_generate_call(tmp_path, monkeypatch):
    """The run's side, on one CPU rank: the job that ``precompile_job`` makes on a GPU (here forced
    on the CPU, and without compilation: what it compiles is the first test's) goes to the helper
    that the command started, the first generate call waits for its first steps, and the helper is
    gone after it."""
    from shardflow.examples.arithmetic import example_config
    from shardflow.parallel.launch import launch
    from shardflow.runtime import driver
    from shardflow.runtime.validate import prepare

    raw = example_config(tmp_path / "example")
    del raw["plan"]
    config = load_config(None, ["run.devices=1", "run.iterations=1", f"run.out_dir={tmp_path / 'run'}",
                                f"run.compile_cache={tmp_path / 'cache'}", "run.progress=false",
                                "run.tensorboard=false", "algorithm.batch_size=2", "generation.samples_per_prompt=2"],
                         base=raw)
    jobs = []

    def cpu_job(config, layout, cfg, world, dtype, *, greedy):
        engine = EngineConfig(max_seq_len=32, max_batch_size=4, kv_block_size=16)
        jobs.append(precompile.Job(cfg=cfg, shard=shard_for(cfg, layout, world.rank), engine=engine, device="cpu",
                                   dtype=dtype, batch=4, modes=("sample",), shared=True, varying=False))
        return jobs[-1]

    monkeypatch.setattr(driver, "precompile_job", cpu_job)
    assert precompile_launch.prestart(force=True)
    helper = precompile_launch._waiting[0]
    launch(driver.train_rank, 1, prepare(config), backend="gloo")
    assert len(jobs) == 1 and precompile_launch._waiting is None
    assert helper.wait(30) == 0  # it had ended: its first steps were its only ones
    logs = tmp_path / "run" / "logs"
    assert "ready: " in (logs / "precompile-rank0.log").read_text()
    assert not (logs / "precompile-rank0.ready").exists()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["time/precompile_wait/actor_gen"] >= 0
