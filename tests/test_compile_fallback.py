"""A compiler failure costs speed, never the run: the function runs eager, with a logged warning. The
compile cache and the compile workers started at setup."""

import os
import re
import subprocess
import sys

import pytest
import torch

from shardflow.engine.compile_cache import kernel_compile_seconds, start_compile_workers, use_compile_cache
from shardflow.engine.compile_fallback import compiled_or_eager
from shardflow.engine.generate.steps import step_compile_options
from shardflow.models.transformer import TRIAL_TOKENS


def _broken_backend(gm, example_inputs):
    raise RuntimeError("no code for this pattern")


def test_a_failing_compiler_falls_back_to_the_eager_function_and_says_so(caplog):
    calls = []

    def double(x):
        calls.append(1)
        return 2 * x

    run = compiled_or_eager(double, "the doubler", backend=_broken_backend)
    assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))
    assert re.search("(?s)torch.compile of the doubler failed.*no code for this pattern", caplog.text)
    n = len(calls)
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))  # eager from now on, no new warning
    assert len(calls) == n + 1


def test_a_failing_compiler_setting_falls_back_to_the_other_settings_first(caplog):
    compiled_with = []

    def counting_backend(gm, example_inputs):
        compiled_with.append("fallback")
        return gm.forward

    run = compiled_or_eager(lambda x: 2 * x, "the doubler", fallback={"backend": counting_backend},
                            backend=_broken_backend)
    assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))
    assert compiled_with == ["fallback"]  # compiled with the fallback, not run eager
    assert re.search("(?s)torch.compile of the doubler failed, compiling it again with.*no code for this pattern",
                     caplog.text)
    assert "running it eager" not in caplog.text
    assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0)) and compiled_with == ["fallback"]


def test_the_decode_step_compiles_with_combo_kernels_and_falls_back_without_them():
    options, fallback = step_compile_options("max-autotune-no-cudagraphs")  # the mode's own options kept
    assert options["options"]["combo_kernels"] is True and options["options"]["max_autotune"] is True
    assert fallback["options"]["combo_kernels"] is False and fallback["options"]["max_autotune"] is True
    assert step_compile_options("default", combo_kernels=False)[0] == {"options": {"combo_kernels": False}}


def test_an_error_of_the_function_itself_still_raises(caplog):
    def bad(x):
        raise ValueError("bad input")

    run = compiled_or_eager(bad, "bad", backend="eager")
    with pytest.raises(ValueError, match="bad input"):
        run(torch.ones(1))
    assert "torch.compile of bad failed" in caplog.text


def test_past_the_recompile_limit_the_function_runs_eager_and_says_so(caplog):
    run = compiled_or_eager(lambda x: 2 * x, "the doubler", backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))
        # a second variant (another dtype) is past the limit: a warning, not a silent eager run
        assert torch.equal(run(torch.ones(3, dtype=torch.float64)), torch.full((3,), 2.0, dtype=torch.float64))
        assert re.search("torch.compile of the doubler failed.*[Rr]ecompile", caplog.text)


def test_the_compile_cache_goes_where_the_run_says_and_workers_start_early(tmp_path, monkeypatch):
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    # importing torch's compiler writes its default into the environment: that is no one's choice
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    # the configs' own patching (an alias among them is not an attribute that monkeypatch restores)
    with torch._inductor.config.patch(fx_graph_cache=False, compile_threads=2), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        assert use_compile_cache("") is None
        assert use_compile_cache(str(tmp_path / "cache")) == tmp_path / "cache"
        assert cache_dir() == str(tmp_path / "cache" / f"inductor-trial{TRIAL_TOKENS}")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cache" / "flash_attn_cute")
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
        assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
        # a directory set by someone (a cluster's shared cache) stays
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
        use_compile_cache(str(tmp_path / "cache"))
        assert cache_dir() == str(tmp_path / "shared")
        assert start_compile_workers()
        AsyncCompile.wait_pool_ready(timeout=120)  # raises if the workers never come up
        assert AsyncCompile.use_process_pool()


NEVER_COMPILES = """
import sys
import torch
import shardflow.runtime.driver  # everything a rank imports
from shardflow.config.model import ModelConfig, RopeConfig
from shardflow.models.transformer import build_model
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import shard_for

cfg = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=32, hidden_size=16,
                  intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=64)
model = build_model(cfg, shard_for(cfg, Layout.parse("d1p1t1@0"), 0), None, "cpu", torch.float32)
torch.nn.init.normal_(model.model.embed_tokens.weight)
model(torch.arange(8)[None], torch.arange(8)[None]).sum().backward()
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
"""


def test_kernel_compile_seconds_counts_shardflow_kernels_compiled_not_cache_hits_nor_others():
    """Triton's compilation listener, as Triton calls it (simulated: no GPU here): a shardflow
    kernel's compilation counts its microseconds, a cache hit and another module's kernel do not,
    and a listener set before it still hears every compilation."""
    knobs = pytest.importorskip("triton.knobs").compilation
    if not hasattr(knobs, "listener"):
        pytest.skip("this Triton has no compilation listener")
    heard = []
    knobs.listener = lambda **kw: heard.append(kw["cache_hit"])
    kernel_compile_seconds()  # installs its listener over the one set above
    start = kernel_compile_seconds()

    def compiled(module: str, cache_hit: bool, micros: int):
        fn = type("JIT", (), {"fn": type("F", (), {"__module__": module})})()
        times = type("T", (), {"total": micros})()
        knobs.listener(src=type("Src", (), {"fn": fn})(), metadata={}, metadata_group={}, times=times,
                       cache_hit=cache_hit)

    compiled("shardflow.models.token_stats", False, 1_500_000)
    compiled("shardflow.models.token_stats", True, 2_000_000)
    compiled("torch._inductor.generated", False, 3_000_000)
    assert kernel_compile_seconds() - start == pytest.approx(1.5)
    assert heard[-3:] == [False, True, False]


def test_a_process_that_never_compiles_never_loads_the_compiler():
    # Importing torch's compiler (and sympy, its symbolic shapes') costs seconds in every rank,
    # worker and tool; only processes that compile (layers on accelerators) should pay it.
    out = subprocess.run([sys.executable, "-c", NEVER_COMPILES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
