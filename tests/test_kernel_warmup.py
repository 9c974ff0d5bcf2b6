"""Kernels compiled ahead of their first launch (``engine.compile_cache.compile_ahead``): the decode
step's (``engine.generate.kernel_warmup``) with the specialisations that an engine's first decode
step launches, and failures contained. Training's: ``test_token_stats``, ``test_grad_accumulate``."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import local_model
from test_token_stats import Recorder

from shardflow.engine.compile_cache import compile_ahead
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.sampling import GREEDY, SAMPLE
from shardflow.engine.generate.steps import decode_start

pytest.importorskip("triton")


@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("batch,mode", [(6, SAMPLE), (2, GREEDY)])
def test_warmed_decode_kernels_are_the_variants_the_first_step_launches(checkpoints, monkeypatch, block_size, batch,
                                                                          mode):
    """``compile_kernels`` warms, from an engine's settings alone, the decode attention kernels
    that a step over its cache launches (its largest batch: one split, or three and their merge;
    a paged cache or a contiguous one; prompt-KV sharing) and the sampler's kernel over the
    model's logits, in the run's mode."""
    from shardflow.engine.generate import decode_attention as da
    from shardflow.engine.generate import kernel_warmup
    from shardflow.engine.generate import sampling_kernel as sk

    kernels = [(da, "_prompt_kernel"), (da, "_split_kernel"), (da, "_merge_kernel"), (sk, "_candidates_kernel")]
    recorders = {}
    for module, name in kernels:
        recorders[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    model = local_model(checkpoints.get("qwen3_qknorm", "qwen3", tie_word_embeddings=True))
    config = EngineConfig(max_seq_len=300, max_batch_size=batch, kv_block_size=block_size)
    engine = GenerationEngine(model, config)
    engine.reset_cache()
    cache, B = engine.cache, config.max_batch_size
    slots = torch.arange(B)
    positions = torch.full((B,), 5)
    h, _, _, _, blocks, _, lengths = decode_start(model, cache, torch.ones(B, dtype=torch.long), positions, slots)
    groups, prompt = torch.arange(B) // 3, torch.full((B,), 3)  # the engine's int rows
    layer = model.shard.layers[0]
    q = torch.empty(B, model.shard.num_heads, model.cfg.head_dim)
    da.decode_attention_triton(q, cache.k[layer], cache.v[layer], blocks, lengths, None, (groups, prompt))
    logits = model.logits(h[:, 0])
    sk.candidates_triton(logits, torch.ones(B), torch.zeros(B, dtype=torch.long), positions + 1,
                         model.shard.vocab_start, mode == SAMPLE)
    kernel_warmup.compile_kernels(torch.device("cpu"), logits.dtype, model.cfg, model.shard, config, mode=mode,
                                  shared_prompts=True)
    assert recorders["_split_kernel"].launched and recorders["_candidates_kernel"].launched
    assert bool(recorders["_merge_kernel"].launched) == (batch == 2)  # three splits on 4 CPU "SMs"
    for name, recorder in recorders.items():
        assert recorder.warmed == recorder.launched, name


def test_nothing_compiles_ahead_off_cuda_and_a_failure_is_contained(checkpoints, caplog):
    """The warm-ups start only on CUDA devices (with Triton's attention); a failure of one is
    logged and raises nothing (the launches compile what it did not)."""
    from shardflow.engine.generate import kernel_warmup
    from shardflow.engine.train import kernel_warmup as train_warmup

    model = local_model(checkpoints.get("llama", "llama"))
    assert train_warmup.start(model) is None
    assert kernel_warmup.start(torch.device("cpu"), torch.float32, model.cfg, model.shard, EngineConfig(),
                               mode=SAMPLE, shared_prompts=True) is None
    with caplog.at_level("WARNING"):
        compile_ahead(torch.device("cpu"), "the test's kernels", lambda: None).result()  # no CUDA device to set
    assert "compiling the test's kernels ahead failed" in caplog.text


def test_a_warmed_kernel_is_loaded_as_its_first_launch_would_load_it():
    """``models.triton_warmup.warmup`` compiles with the launch's arguments and grid, then runs
    Triton's first-launch step (the launcher's build, the module's load) at once; a stand-in
    without one (the tests' recorders) is left as it is."""
    from shardflow.models.triton_warmup import warmup

    class Compiled:
        loaded = 0

        def _init_handles(self):
            self.loaded += 1

    class Kernel:
        def warmup(self, *args, grid, **options):
            self.call = (args, grid, options)
            return self.compiled

    kernel = Kernel()
    kernel.compiled = Compiled()
    assert warmup(kernel, (3,))(1, "x", BLOCK=4) is kernel.compiled
    assert kernel.call == ((1, "x"), (3,), {"BLOCK": 4}) and kernel.compiled.loaded == 1
    kernel.compiled = None
    assert warmup(kernel, (1,))() is None


@pytest.mark.parametrize("backward", [False, True])
def test_the_attention_warm_up_runs_the_model_s_attention_with_its_heads(backward, monkeypatch):
    """``warm_attention`` runs ``causal_attention`` (the prefill's and training's) once on grouped
    query heads of the model's size, and its backward where asked."""
    from shardflow.models import transformer

    calls = []
    real = transformer.causal_attention

    def recorded(q, k, v, window):
        calls.append((tuple(q.shape), tuple(k.shape), window, q.requires_grad))
        return real(q, k, v, window)

    monkeypatch.setattr(transformer, "causal_attention", recorded)
    transformer.warm_attention(torch.device("cpu"), torch.bfloat16, 8, 2, 16, backward=backward)
    assert calls == [((1, 8, 64, 16), (1, 2, 64, 16), None, backward)]
