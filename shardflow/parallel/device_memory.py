"""The device memory a call can still take, as the calls that size themselves by it count it."""

from __future__ import annotations

import torch


def free_bytes(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA ``device``: the device's free memory plus
    what torch's caching allocator holds unused (the calls before left it there, for reuse)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
