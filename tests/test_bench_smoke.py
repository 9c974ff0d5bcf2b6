"""Each benchmark's CPU mode runs to the end and writes its JSON, so that a script broken by a
change is found here rather than on a GPU machine; decode_profile's attention sweep, which only
GPUs run, goes through Triton's interpreter. (The figures are not checked: on a CPU they mean
nothing; bench/ and BENCHMARKS.md hold the measured ones.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from background import Background, selected

BENCH = Path(__file__).resolve().parents[1] / "bench"

CASES = {  # script: (arguments, JSON it writes)
    "generation.py": (["--tiny", "--skip-transformers"], "generation.json"),
    "decode_profile.py": (["--tiny"], "decode_profile.json"),
    "iteration.py": (["--tiny", "--iterations", "2", "--trl-steps", "2"], "iteration.json"),
    "train_step.py": (["--tiny", "--steps", "2"], "train_step.json"),
    "token_stats.py": (["--tiny"], "token_stats.json"),
    "shared_prompts.py": (["--tiny"], "shared_prompts.json"),
    "train_attention.py": (["--tiny"], "train_attention.json"),
    "adaptive_tp.py": (["--tiny", "--one-device"], "adaptive_tp.json"),
    "planner_accuracy.py": (["--tiny"], "planner_accuracy.json"),
    "planner.py": (["--gpus", "16", "--time-limit", "2"], "planner.json"),
    "multiturn.py": (["--tiny", "--repeat", "1", "--workers", "2"], "multiturn.json"),
    "reward_pool.py": (["--responses", "16", "--workers", "1,2"], "reward_pool.json"),
    "optimizer_offload.py": (["--tiny"], "optimizer_offload.json"),
    "paged_kv.py": (["--tiny"], "paged_kv.json"),
    "varied_lengths.py": (["--tiny"], "varied_lengths.json"),
    "attention_plans.py": (["--tiny"], "attention_plans.json"),
    "layer_tracing.py": (["--tiny", "--repeats", "1"], "layer_tracing.json"),
    "example_run.py": (["--runs", "1", "--iterations", "1"], "example_run.json"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Background:
    """The module's subprocess checks, started together (``background``): each selected script's
    CPU mode (writing into ``outs[script]``), and the two checks in Triton's interpreter below."""
    bg = Background()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    for item in selected(request, "test_benchmark_runs_on_cpu"):
        script = item.callspec.params["script"]
        bg.outs[script] = tmp_path_factory.mktemp(script.removesuffix(".py"))
        bg.start(script, [sys.executable, str(BENCH / script), *CASES[script][0], "--out", str(bg.outs[script])],
                 env=env, timeout=300)
    if importlib.util.find_spec("triton") is not None:
        interpret = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        if selected(request, "test_decode_profile_sweep_and_summary_in_the_interpreter"):
            code = "import test_bench_smoke as t; t.check_decode_profile_summary(); print('checked')"
            bg.start("decode_profile_summary", [sys.executable, "-c", code], cwd=Path(__file__).parent, env=interpret,
                     timeout=300)
        if selected(request, "test_prompt_kv_cascade_equals_the_engine_kernel_in_the_interpreter"):
            bg.outs["prompt_kv"] = tmp_path_factory.mktemp("prompt_kv")
            bg.start("prompt_kv", [sys.executable, str(BENCH / "prompt_kv_attention.py"), "--tiny", "--block-size", "8",
                                   "--sweep", "--out", str(bg.outs["prompt_kv"])],
                     env={**interpret, "CUDA_VISIBLE_DEVICES": ""},
                     timeout=300)
        if selected(request, "test_decode_products_triton_matches_cublas_in_the_interpreter"):
            bg.outs["products"] = tmp_path_factory.mktemp("products")
            bg.start("products", [sys.executable, str(BENCH / "decode_products_triton.py"), "--tiny", "--out",
                                  str(bg.outs["products"])], env={**interpret, "CUDA_VISIBLE_DEVICES": ""},
                     timeout=300)
    yield bg
    bg.close()


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_on_cpu(script, runs):
    done = runs.result(script)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    result = json.loads((runs.outs[script] / CASES[script][1]).read_text())
    assert isinstance(result, dict)
    # the planner's estimate is contained (so that the measurements survive) but must not fail here
    # (TRL may: it is not a test dependency)
    assert "error" not in result.get("planner", {}), result["planner"]


def check_decode_profile_summary() -> None:
    """The attention sweep (in the interpreter) and the summary printed from it, on a case whose
    split count is capped by the cache's blocks (128 positions + the new one: 3 blocks of 64)."""
    sys.path.insert(0, str(BENCH))
    import decode_profile as dp
    from generation import TINY, llama_config

    rows = dp.attention_sweep(torch.device("cpu"), llama_config(TINY), [(1, 128)], torch.float32)
    assert any(r["picked"] for r in rows) and not any("error" in r for r in rows)
    dp.print_summary({"attention": rows, "linear": [], "sampler": [], "profile": {}})


def test_decode_profile_sweep_and_summary_in_the_interpreter(runs):
    pytest.importorskip("triton")
    done = runs.result("decode_profile_summary")
    assert done.returncode == 0 and "checked" in done.stdout and "attention b1 ctx128: picked" in done.stdout, \
        done.stderr[-4000:]


def test_prompt_kv_cascade_equals_the_engine_kernel_in_the_interpreter(runs):
    """The cascade of bench/prompt_kv_attention.py (the prompt's positions read once per prompt)
    gives the engine's decode attention output and the plain torch attention's, over a paged cache
    whose blocks lie in a random order; its knob sweep times every setting."""
    pytest.importorskip("triton")
    done = runs.result("prompt_kv")
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((runs.outs["prompt_kv"] / "prompt_kv_attention.json").read_text())
    rows = result["rows"]
    assert rows and all(r["max_abs_diff"] < 1e-5 and r["max_abs_diff_torch"] < 1e-5 for r in rows)
    assert result["block_size"] == 8 and len(result["sweep"]) == 3 and all("mean_us" in r for r in result["sweep"])


def test_decode_products_triton_matches_cublas_in_the_interpreter(runs):
    """bench/decode_products_triton.py's tiles, one K split and three (uneven), give the plain product."""
    pytest.importorskip("triton")
    done = runs.result("products")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((runs.outs["products"] / "decode_products_triton.json").read_text())["rows"]
    triton_rows = [r for r in rows if r["library"] == "triton"]
    assert triton_rows and all(r["max_abs_diff"] < 1e-5 for r in triton_rows), rows


def test_every_suite_step_names_a_script_and_what_it_writes():
    """bench/run.py's suites: each step runs a script of bench/ whose CPU mode is tested above (or
    one that only measures GPUs), and keeps the JSON that script writes."""
    sys.path.insert(0, str(BENCH))
    import run as runner

    for suite, steps in runner.SUITES.items():
        for step in steps:
            assert (BENCH / step.script).is_file(), (suite, step.name)
            written = CASES.get(step.script, (None, step.script.replace(".py", ".json")))[1]
            assert written in step.keep, (suite, step.name, written)
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--list"], capture_output=True, text=True)
    assert done.returncode == 0 and "decode:" in done.stdout and "iteration:" in done.stdout
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "nosuch", "--out", "x"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "unknown suite(s) ['nosuch']" in done.stderr


def test_device_idle_charges_each_gap_to_what_the_host_was_doing():
    """bench/train_step.py's idle-time attribution on a hand-made trace: a 95 us wait before the
    first kernel while the host planned (in a copy), a 35 us one in the forward range, and a 10 us
    launch gap under the threshold, counted apart."""
    sys.path.insert(0, str(BENCH))
    from train_step import device_idle

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        event("user_annotation", "shardflow.plan", 0, 100), event("cpu_op", "aten::to", 10, 80),
        event("cuda_runtime", "cudaMemcpyAsync", 20, 60), event("user_annotation", "shardflow.forward", 100, 200),
        event("kernel", "gemm", 95, 55), event("kernel", "gemm", 160, 5), event("gpu_memcpy", "copy", 200, 100),
    ]}
    idle = device_idle(trace)
    assert idle["gaps"] == 2 and idle["idle_ms"] == pytest.approx(0.130)
    assert idle["idle_ms_by_range"] == pytest.approx({"shardflow.plan": 0.095, "shardflow.forward": 0.035})
    assert idle["short_idle_ms"] == pytest.approx(0.010) and idle["busy_ms"] == pytest.approx(0.160)
    assert idle["longest"][0]["host_op"] == "aten::to > cudaMemcpyAsync" and idle["longest"][1]["host_op"] == "-"


def test_paired_runs_a_benchmark_on_the_checkout_and_an_exported_commit(tmp_path):
    """bench/paired.py in a clone of this repository (this checkout's paired.py copied in): a
    commit's tree exported with the checkout's bench/, then one script run in both and in the
    checkout under a variant's environment and with a variant's arguments, two rounds in alternating order."""
    if subprocess.run(["git", "-C", str(BENCH.parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(BENCH.parent), str(clone)], check=True)
    (clone / "bench" / "paired.py").write_text((BENCH / "paired.py").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    paired = [sys.executable, str(clone / "bench" / "paired.py")]
    done = subprocess.run([*paired, "prepare", "--trees", "HEAD"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    [tree] = (clone / "_trees").iterdir()
    assert (tree / "bench" / "paired.py").read_text() == (BENCH / "paired.py").read_text()
    assert "/_trees/" in (clone / ".git" / "info" / "exclude").read_text()
    assert "_trees" not in subprocess.run(["git", "-C", str(clone), "status", "--porcelain"], capture_output=True,
                                          text=True).stdout
    done = subprocess.run([*paired, "run", "--out", str(tmp_path / "out"), "--script", "token_stats.py", "--grep",
                           "variant", "--variant", "probe:SHARDFLOW_PROBE=1", "--variant-args", "again:--tiny", "--rounds", "2",
                           "--", "--tiny"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    runs = json.loads((tmp_path / "out" / "paired.json").read_text())["runs"]
    order = ["head", tree.name, "probe", "again"]
    assert [(r["name"], r["round"]) for r in runs] == [(n, 1) for n in order] + [(n, 2) for n in order[::-1]]
    assert [r["env"] for r in runs[:4]] == [{}, {}, {"SHARDFLOW_PROBE": "1"}, {}]
    assert [r["extra_args"] for r in runs[:4]] == [[], [], [], ["--tiny"]]
    assert all(r["returncode"] == 0 for r in runs)
    assert all((tmp_path / "out" / f"{r['name']}.r{r['round']}" / "token_stats.json").is_file() for r in runs)
    bad = subprocess.run([*paired, "run", "--out", str(tmp_path / "bad"), "--script", "token_stats.py", "--variant",
                          "probe", "--", "--tiny"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "--variant 'probe'" in bad.stderr and not (tmp_path / "bad").exists()
    bad = subprocess.run([*paired, "run", "--out", str(tmp_path / "bad"), "--script", "token_stats.py",
                          "--variant-args", "again:", "--", "--tiny"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "--variant-args 'again:'" in bad.stderr and not (tmp_path / "bad").exists()


def test_stack_sampler_charges_a_module_s_time_to_the_function_that_spent_it(tmp_path):
    """bench/stack_sampler.py runs a module with its arguments, samples its threads' stacks, and its
    report charges the wall time to the function that spent it, on the timeline too."""
    (tmp_path / "busy.py").write_text(textwrap.dedent("""
        import sys, time

        def spin(seconds):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        spin(float(sys.argv[1]))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    samples = tmp_path / "stacks.json"
    sampler = [sys.executable, str(BENCH / "stack_sampler.py")]
    done = subprocess.run([*sampler, "--out", str(samples), "--interval", "0.005", "-m", "busy", "0.5"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = subprocess.run([*sampler, "--report", str(samples)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    innermost = report.stdout.split("innermost frames (s):")[1].split("timeline")[0].splitlines()[1]
    seconds, frame = innermost.split()
    assert frame.endswith("busy.py:spin:6") and 0.4 < float(seconds) < 0.7, report.stdout
