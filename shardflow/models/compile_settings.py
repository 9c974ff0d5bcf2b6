"""The compiler settings every torch.compile of shardflow runs under, in one place.

Inductor's graph cache keys a graph by its settings too: a process that compiles ahead for another
(``engine.generate.precompile``) fills the cache with what that process finds only if both compile
under the same settings, whatever each compiled first.
"""

from __future__ import annotations


def apply() -> None:
    """Set them (idempotent; imports dynamo and inductor, seconds the first time)."""
    import torch._dynamo
    import torch._inductor.config

    # One code object serves every layer of every model, in both grad modes and several shape classes
    # (size-1 dimensions specialise), and every engine of a process (models, dtypes, batch buckets,
    # sampling modes) shares its decode step's: past dynamo's recompile limit (8 by default) new
    # variants would run eager without notice beyond a log line.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor fuses the norms' weight-gradient reductions with their input-gradient ones only for
    # inputs of at least 5M elements, and guards that size: a micro-batch under it (the last, smaller
    # one) would compile the layer again, seconds of the first iteration. Fusing them at every size
    # keeps one variant.
    if hasattr(torch._inductor.config.triton, "mix_order_reduction_non_strict_mode"):
        torch._inductor.config.triton.mix_order_reduction_non_strict_mode = True
