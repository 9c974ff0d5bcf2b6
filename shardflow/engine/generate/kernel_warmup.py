"""The decode step's own Triton kernels compiled ahead, in the background, while the run sets up.

Decode attention's kernels (``decode_attention``) and the sampler's (``sampling_kernel``) compile
at their first launch inside the first decode step: about 1-1.6 s of a cold first generate call
on an H100, while the run's setup (loading, the training layers' trial compilation) leaves the
host's threads mostly waiting. ``start`` compiles them in the background for the step that
the engine will run first (the largest batch, the run's sampling mode, prompt-KV sharing as the
run's samples ask); other batches and modes compile at their first launch, as before.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from shardflow.config.model import ModelConfig
from shardflow.engine.compile_cache import compile_ahead
from shardflow.engine.generate import decode_attention, sampling_kernel
from shardflow.engine.generate.engine import EngineConfig
from shardflow.engine.generate.kv_cache import block_layout
from shardflow.engine.generate.sampling import FILTER, SAMPLE
from shardflow.models.transformer import warm_attention
from shardflow.parallel.sharding import RankShard


def start(device: torch.device, dtype: torch.dtype, cfg: ModelConfig, shard: RankShard, config: EngineConfig, *,
          mode: str, shared_prompts: bool) -> Future | None:
    """Compile in the background (``compile_ahead``) the kernels of an engine with ``config`` on this rank's
    ``shard`` (its device: CUDA, with Triton; the Triton attention), for batches in sampling
    ``mode``, with prompt-KV sharing where ``shared_prompts`` (samples of one prompt decoded
    together); returns the job, or None where nothing is compiled."""
    if device.type != "cuda" or decode_attention.triton is None or config.attention == "torch":
        return None
    return compile_ahead(device, "the decode step's kernels",
                         lambda: compile_kernels(device, dtype, cfg, shard, config, mode=mode,
                                                 shared_prompts=shared_prompts))


def compile_kernels(device: torch.device, dtype: torch.dtype, cfg: ModelConfig, shard: RankShard,
                    config: EngineConfig, *, mode: str, shared_prompts: bool) -> None:
    """The warm-ups (see ``start``), for a step of ``config.max_batch_size`` rows: the engine's
    first decode step holds that many when the requests fill its slots."""
    max_len = (config.max_seq_len or cfg.max_position_embeddings) - 1  # as ``GenerationEngine.reset_cache``
    positions, blocks_per_row = block_layout(max_len, config.kv_block_size)
    warm_attention(device, dtype, shard.num_heads, shard.num_kv_heads, cfg.head_dim, backward=False)  # the prefill's
    decode_attention.warm_kernels(
        device, dtype, batch=config.max_batch_size, heads=shard.num_heads, kv_heads=shard.num_kv_heads,
        head_dim=cfg.head_dim, block_size=positions, blocks_per_row=blocks_per_row,
        windows=[cfg.sliding_windows[i] for i in shard.layers], shared=shared_prompts and config.share_prompt_kv)
    if shard.last_stage and mode != FILTER:  # the filtered mode samples in torch
        sampling_kernel.warm_kernels(device, dtype, batch=config.max_batch_size, vocab=shard.vocab_size,
                                     vocab_start=shard.vocab_start, sample=mode == SAMPLE)
