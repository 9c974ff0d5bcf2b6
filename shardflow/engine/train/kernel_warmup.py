"""Training's own Triton kernels compiled ahead, in the background, while the run sets up.

The head's statistics and gradient kernels (``models.token_stats``) and the gradient accumulation
(``engine.train.grad_accumulate``) compile at their first launch: about 4 s of a cold first
training call on an H100, on the training's critical path, while the run's setup (loading, the
layers' trial compilation) and its first generation leave the host's threads mostly waiting.
``start`` compiles them in the background (``engine.compile_cache.compile_ahead``) for the
specialisations that training will launch; a launch that finds its variant compiled costs nothing
more, one that does not (another specialisation) compiles as it did before. A failure here is
logged and costs nothing else.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future

import torch

from shardflow.engine.compile_cache import compile_ahead
from shardflow.engine.train import grad_accumulate
from shardflow.models import token_stats
from shardflow.models.transformer import Transformer, warm_attention


def start(model: Transformer) -> Future | None:
    """Compile ``model``'s training kernels in the background (``compile_ahead``; its device: CUDA,
    with Triton); returns the job, or None where nothing is compiled."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda" or token_stats.triton is None:
        return None
    try:
        head_rows = model.head_weight().shape[0]
    except RuntimeError:  # no LM head on this rank (a pipeline stage before the last, a value model)
        head_rows = 0
    numel = sum(p.numel() for p in model.parameters())  # the gradient buffer's size, at most
    shard = model.shard
    return compile_ahead(param.device, "training's kernels",
                         functools.partial(compile_kernels, param.dtype, head_rows, shard.vocab_start, numel,
                                           attention=(shard.num_heads, shard.num_kv_heads, model.cfg.head_dim)))


def compile_kernels(dtype, head_rows: int, vocab_start: int, numel: int,
                    attention: tuple[int, int, int] | None = None) -> None:
    """The warm-ups, on the current CUDA device: the head's kernels over ``head_rows`` local
    vocabulary rows (none: no head here), the accumulation into a buffer of ``numel`` elements, and
    ``attention`` (heads, KV heads, head size) forward and backward (``warm_attention``)."""
    if head_rows:
        token_stats.warm_kernels(dtype, head_rows, vocab_start)
    grad_accumulate.warm_kernels(dtype, numel)
    if attention is not None:
        warm_attention(torch.device("cuda", torch.cuda.current_device()), dtype, *attention, backward=True)
